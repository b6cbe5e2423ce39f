// A build without CUDA (meson found no nvcc, or -Dcuda=disabled): the CUDA entry points say so.
#include "runtime/cuda_attention.h"

namespace kvsim::runtime::cuda {

bool device_available(std::string& why) {
    why = "this kvsim was built without CUDA (no nvcc at configure time, or -Dcuda=disabled)";
    return false;
}

std::unique_ptr<DeviceCache> DeviceCache::create(const std::vector<HeadLayout>&, int, int, int, std::string& error) {
    std::string why;
    device_available(why);
    error = "backend 'cuda': " + why;
    return nullptr;
}

}  // namespace kvsim::runtime::cuda
