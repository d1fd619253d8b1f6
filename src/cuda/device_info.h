// What the CUDA backend knows about the machine: device count and properties read from the
// device (never hard-coded), and the CUTLASS version it was built with.
#pragma once

#include <string>

namespace moekit::cuda {

struct DeviceInfo {
  int device = -1;
  std::string name;
  int sm_major = 0, sm_minor = 0;
  int num_sms = 0;
  long long l2_bytes = 0;
  long long global_memory_bytes = 0;
  long long max_smem_per_block_optin = 0;
};

// Number of CUDA devices; 0 when there is no driver or no device (never an error).
int device_count();
DeviceInfo device_info(int device);
std::string cutlass_version();

}  // namespace moekit::cuda
