// The runtime's C++ side door, for kvsim's own tests: a "cuda" runtime whose device cache comes
// from `make_device` instead of CUDA, so the device path (staging changed slots, attending by
// slot, completing each head's step from the device's weights) runs where no GPU is.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/cuda_attention.h"
#include "runtime/kvsim_runtime.h"

namespace kvsim::runtime {

using DeviceFactory = std::function<std::unique_ptr<cuda::DeviceCache>(
    const std::vector<HeadLayout>& heads, int num_kv_heads, int group, int head_dim, std::string& error)>;

kvsim_status create_with_device(const char* profile_path, const kvsim_model_shape& shape, DeviceFactory make_device,
                                kvsim_rt** out);

}  // namespace kvsim::runtime
