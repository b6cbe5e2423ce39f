// Helpers shared by the model tests: where the real model lives, scratch directories.
#pragma once

#include <doctest/doctest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "base/size_limits.h"
#include "model/llama.h"

#ifndef KVSIM_SHARED_DIR
#define KVSIM_SHARED_DIR "../shared"
#endif

namespace kvsim::model::testing {

// The shared data folder: $KVSIM_SHARED_DIR when set, else the path meson compiled in.
inline std::filesystem::path shared_dir() {
    if (const char* from_environment = std::getenv("KVSIM_SHARED_DIR")) return from_environment;
    return KVSIM_SHARED_DIR;
}
inline std::filesystem::path stories260k_dir() { return shared_dir() / "models" / "stories260K"; }
inline std::filesystem::path stories260k_gguf() { return stories260k_dir() / "stories260K.gguf"; }

// True when the real model is present; otherwise says why the calling test does nothing.
inline bool have_stories260k() {
    if (std::filesystem::exists(stories260k_gguf())) return true;
    MESSAGE("SKIPPED: " << stories260k_gguf().string() << " is absent (the shared model folder is not mounted)");
    return false;
}

// A fresh directory under the system temp dir, removed with everything in it at scope exit.
class ScratchDir {
  public:
    ScratchDir() {
        static std::atomic<int> counter{0};
        path_ = std::filesystem::temp_directory_path() /
                ("kvsim_model_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
        std::filesystem::create_directories(path_);
    }
    ~ScratchDir() {
        std::error_code ignored;
        std::filesystem::remove_all(path_, ignored);
    }
    ScratchDir(const ScratchDir&) = delete;
    ScratchDir& operator=(const ScratchDir&) = delete;

    std::string file(const std::string& name) const { return (path_ / name).string(); }

  private:
    std::filesystem::path path_;
};

// Sets the memory limit (base/size_limits.h) for a scope, restoring the previous one after.
class MemoryLimit {
  public:
    explicit MemoryLimit(uint64_t bytes) : saved_(kvsim::memory_limit_bytes()) { kvsim::set_memory_limit_bytes(bytes); }
    ~MemoryLimit() { kvsim::set_memory_limit_bytes(saved_); }
    MemoryLimit(const MemoryLimit&) = delete;
    MemoryLimit& operator=(const MemoryLimit&) = delete;

  private:
    uint64_t saved_;
};

// A small Llama shape with grouped-query attention (2 query heads per KV head), cheap to run.
inline LlamaConfig tiny_config() {
    LlamaConfig config;
    config.dim = 64;
    config.hidden_dim = 96;
    config.n_layers = 2;
    config.n_heads = 4;
    config.n_kv_heads = 2;
    config.head_dim = 16;
    config.vocab_size = 300;
    config.context_length = 64;
    config.rope_theta = 10000.0f;
    config.norm_eps = 1e-5f;
    return config;
}

}  // namespace kvsim::model::testing
