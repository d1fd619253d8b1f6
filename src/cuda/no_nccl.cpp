// The NCCL transports' entry points when moekit is built without NCCL's device API (no CUDA, or no
// NCCL >= 2.28 found): the host classes and their declarations stay (`moekit plan` shows them), and
// running them raises moekit::Error saying how to get NCCL.
#include "cuda/ep_launch.h"
#include "moekit/check.h"

namespace moekit::cuda {
namespace {

[[noreturn]] void no_nccl(const char* what) {
  MOEKIT_FAIL(
      "{}: moekit was built without NCCL's device API (NCCL >= 2.28 with nccl_device.h); install it (python3 -m pip "
      "install nvidia-nccl-cu13==2.28.9, or the CUDA toolkit's NCCL) and rebuild with CUDA",
      what);
}

}  // namespace

class NcclGroup {};

bool nccl_built() {
  return false;
}
std::string nccl_compiled_version() {
  return "none";
}
std::shared_ptr<NcclGroup> make_nccl_group(Communicator&) {
  no_nccl("the NCCL communicator");
}
std::unique_ptr<Memory> make_symmetric_memory(std::shared_ptr<NcclGroup>) {
  no_nccl("NCCL symmetric memory");
}
void launch_ep_dispatch(const EpStep&, NcclGroup&, bool, void*) {
  no_nccl("the NCCL dispatch");
}
void launch_ep_combine(const EpStep&, NcclGroup&, bool, void*) {
  no_nccl("the NCCL combine");
}
void abort_nccl_group(NcclGroup&, const std::string&) {}
void set_ep_teardown(NcclGroup&, const EpStep&) {}
void connect_nccl_peers(NcclGroup&, void*) {
  no_nccl("the NCCL connections");
}
double measure_peer_gbs(NcclGroup&, void*) {
  no_nccl("the NCCL bandwidth");
}

}  // namespace moekit::cuda
