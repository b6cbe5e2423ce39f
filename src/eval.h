// `kvsim eval`: the truth behind the proxies. The model reads text teacher-forced with each
// (policy, budget) of a config controlling its own KV cache: an evicted position is masked out of
// attention at every later step, per layer and KV head. Perplexity, its rise over the full cache,
// and the proxy metrics of the same run come out side by side, with the Spearman rank correlation
// between each proxy and the rise in perplexity across configurations.
#pragma once
#include <string>
#include <vector>

#include "src/config.h"
#include "src/model_text.h"
#include "src/report.h"

namespace kvsim {

struct EvalOptions {
    ModelInput input;
    bool show_progress = true;
    // Only these sequences of the text (indices), e.g. a search's held-out set; empty: all. With
    // expected_tokens (one list per selected sequence, as a trace stores them), each sequence
    // must tokenize to exactly those tokens.
    std::vector<int> sequences;
    std::vector<std::vector<int32_t>> expected_tokens;
    std::string sequences_where;  // the key that chose them, for errors
    // Positions the model runs at once. 1: token by token, as a decoder runs. Larger chunks run
    // the weight products as matrix-matrix products, several times faster on a long text, with
    // the same policy steps and masks in the same order; results differ only by float rounding.
    int chunk = 1;
};

struct EvalResult {
    std::string description;           // model and text
    // The full cache first (policy "full"), then every combination; with per_sequence, the same
    // again for each sequence.
    std::vector<ResultRecord> records;
    std::size_t configurations = 0;          // combinations beside the full cache
    double full_ppl = 0;                     // infinite when it overflows a double (exp of full_nll)
    double full_nll = 0;                     // mean negative log-likelihood per predicted token (nats)
    long tokens = 0;                         // predicted tokens per configuration
    // Rank correlations with the perplexity rise across configurations, computed on the mean NLL,
    // which orders them as their perplexity does and never overflows.
    double spearman_retained_mass = 0;
    double spearman_heavy_hitter_recall = 0;
    double seconds = 0;
};

// exp(nll) - exp(full_nll), the perplexity rise over the full cache from the mean NLLs. Where a
// perplexity overflows a double it is computed without forming the overflowing terms: finite
// where the difference fits, infinite with its sign where not, 0 for equal NLLs, never NaN.
double perplexity_rise(double nll, double full_nll);

EvalResult run_eval(const ExperimentConfig& config, const std::vector<GridAxis>& extra_axes, const EvalOptions& options);

// The sequences run_eval evaluates: all of `text`'s, or options.sequences, each checked against
// options.expected_tokens (InputError naming the text file). `original` receives each selected
// sequence's index in `text`.
TokenizedText select_eval_sequences(const TokenizedText& text, const EvalOptions& options,
                                    std::vector<std::size_t>& original);

// Spearman's rank correlation (average ranks for ties); NaN when either side is constant.
double spearman(const std::vector<double>& x, const std::vector<double>& y);

}  // namespace kvsim
