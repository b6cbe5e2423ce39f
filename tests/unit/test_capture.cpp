// The shipped real trace is what `kvsim capture` makes from the shared model and text.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>

#include "helpers.h"
#include "src/capture.h"

using namespace kvsim;

TEST_CASE("data/tinystories-stories260K.h5 is reproduced by kvsim capture") {
    const std::string model = KVSIM_SHARED_DIR "/models/stories260K/stories260K.gguf";
    const std::string text = KVSIM_SHARED_DIR "/text/tinystories_sample.txt";
    const std::string shipped = KVSIM_SOURCE_DIR "/data/tinystories-stories260K.h5";
    if (!std::filesystem::exists(model)) {
        MESSAGE("skipped: " << model << " not present");
        return;
    }
    CaptureOptions options;
    options.input = {model, text, "<|endoftext|>", 0, 512};
    options.output_path = test::temp_dir() + "/recaptured.h5";
    capture_trace(options);

    TraceReader fresh(options.output_path), ship(shipped);
    CHECK(fresh.metadata().source_model_sha256 == ship.metadata().source_model_sha256);
    CHECK(fresh.metadata().source_text_sha256 == ship.metadata().source_text_sha256);
    REQUIRE(fresh.sequences().size() == ship.sequences().size());
    double worst = 0;
    for (std::size_t s = 0; s < ship.sequences().size(); ++s) {
        CHECK(fresh.sequences()[s].length == ship.sequences()[s].length);
        CHECK(fresh.read_tokens(s) == ship.read_tokens(s));
        for (int layer = 0; layer < ship.metadata().num_layers; ++layer) {
            const QkvLayer a = fresh.read_qkv(s, layer), b = ship.read_qkv(s, layer);
            for (std::size_t i = 0; i < a.k.size(); ++i) worst = std::max(worst, double(std::abs(a.k[i] - b.k[i])));
            for (std::size_t i = 0; i < a.q.size(); ++i) worst = std::max(worst, double(std::abs(a.q[i] - b.q[i])));
        }
    }
    // The same model and text give the same Q/K up to floating-point summation order (SIMD width).
    CHECK(worst < 1e-3);
}
