// The shipped real trace is what `kvsim capture` makes from the shared model and text.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "helpers.h"
#include "src/capture.h"
#include "src/config.h"
#include "src/eval.h"
#include "src/progress.h"

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

TEST_CASE("kvsim eval in chunks takes the same policy steps as token by token") {
    const std::string model = KVSIM_SHARED_DIR "/models/stories260K/stories260K.gguf";
    const std::string text = KVSIM_SHARED_DIR "/text/tinystories_sample.txt";
    if (!std::filesystem::exists(model)) {
        MESSAGE("skipped: " << model << " not present");
        return;
    }
    // An eviction policy (its masks come from steps taken inside the chunk, position by
    // position) and int4 with key groups of 16, which complete inside a 48-token chunk: a
    // simulated cache, stepped after the model has run the whole chunk's layer, must still see
    // each position's own query.
    const std::string config_path = test::temp_dir() + "/eval_chunks.yaml";
    std::ofstream(config_path) << "budgets: [24]\npolicies:\n  - h2o: {recent_window: 8}\n  - int4: {key_group: 16}\n"
                                  "metrics: [ppl, retained_mass, output_rel_error]\n";
    const ExperimentConfig experiment = load_config(config_path);
    EvalOptions options;
    options.input = {model, text, "<|endoftext|>", 150, 0};  // 150 tokens: the last chunk is partial
    options.sequences = {0};
    options.show_progress = false;
    const EvalResult by_token = run_eval(experiment, {}, options);
    options.chunk = 48;
    const EvalResult by_chunk = run_eval(experiment, {}, options);
    // Matrix-matrix products round differently from matrix-vector ones: close, not equal.
    CHECK(by_chunk.full_ppl == doctest::Approx(by_token.full_ppl).epsilon(1e-5));
    REQUIRE(by_chunk.records.size() == by_token.records.size());
    for (std::size_t i = 0; i < by_token.records.size(); ++i) {
        const ResultRecord &a = by_token.records[i], &b = by_chunk.records[i];
        CAPTURE(a.label);
        CHECK(a.steps == b.steps);
        CHECK(b.ppl == doctest::Approx(a.ppl).epsilon(1e-4));
        CHECK(b.retained_mass == doctest::Approx(a.retained_mass).epsilon(1e-4));
        if (std::isfinite(a.output_rel_error)) CHECK(b.output_rel_error == doctest::Approx(a.output_rel_error).epsilon(1e-3));
    }
}

TEST_CASE("progress bar: the time spent and left read as seconds, minutes or hours") {
    CHECK(ProgressBar::duration(0.04) == "0.0 s");
    CHECK(ProgressBar::duration(12.34) == "12.3 s");
    CHECK(ProgressBar::duration(59.96) == "1 min 00 s");  // not "60.0 s"
    CHECK(ProgressBar::duration(245.4) == "4 min 05 s");
    CHECK(ProgressBar::duration(7620.0) == "2 h 07 min");
}
