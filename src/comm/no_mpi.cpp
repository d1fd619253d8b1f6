// Stands in for src/comm/mpi_communicator.cpp when CMake did not find MPI (or MOEKIT_MPI=OFF), so
// that callers link either way and learn at run time how to get the MPI communicator.
#include "moekit/communicator.h"
#include "moekit/error.h"

namespace moekit {

std::unique_ptr<Communicator> make_mpi_communicator() {
  throw Error("moekit was built without MPI: install libopenmpi-dev (scripts/install-deps.sh) and rebuild");
}

bool mpi_available() {
  return false;
}

}  // namespace moekit
