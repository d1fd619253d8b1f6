// What the CUDA backend knows about the machine: device count and properties read from the
// device (never hard-coded), and the CUTLASS version it was built with.
#pragma once

#include <cstdint>
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
// The GPU of rank `rank` of a multi-GPU run, made current on the calling thread: the node-local rank
// (OMPI_COMM_WORLD_LOCAL_RANK / LOCAL_RANK when set, else `rank`) modulo the devices. Returns it.
// Raises moekit::Error when no device is present.
int use_device_of_rank(int rank);
std::string cutlass_version();
// The calling thread's current device; set_device makes `device` current (bindings that take arrays
// on a given GPU). Both raise moekit::Error without a device.
int current_device();
void set_device(int device);
// True while `stream` (a cudaStream_t) is being captured into a CUDA graph: no allocation or host
// synchronization may happen then.
bool stream_capturing(void* stream);
// Ordering work on a shared buffer across streams (the Python ops' workspaces): an event recorded
// after the work on one stream, waited for by the next stream that uses the buffer.
void* create_event();
void record_event(void* event, void* stream);
void stream_wait_event(void* stream, void* event);
void synchronize_event(void* event);  // waits on the host until the event's work is done
void destroy_event(void* event);

}  // namespace moekit::cuda
