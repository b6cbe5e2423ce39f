// A build without CUDA (meson found no nvcc, or -Dcuda=disabled): the CUDA entry points say so.
#include "src/runtime/cuda_attention.h"

namespace kvsim::runtime::cuda {

bool device_available(std::string& why) {
    why = "this kvsim was built without CUDA (no nvcc at configure time, or -Dcuda=disabled)";
    return false;
}

bool decode_attention(const TierStore (&)[3], const TierStore (&)[3], const std::vector<int>&, const std::vector<uint8_t>&,
                      const std::vector<uint8_t>&, int, int, const float*, float*, float*, std::string& error) {
    device_available(error);
    return false;
}

}  // namespace kvsim::runtime::cuda
