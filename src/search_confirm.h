// Search proposes; the model confirms. Runs `kvsim eval` on the held-out sequences for every
// method and target of a search (the fitted profiles and the baselines, at the same bytes), puts
// each one's rise in perplexity beside its proxy figure, and says whether the proxy's ranking held.
#pragma once
#include "search/search.h"
#include "src/model_text.h"

namespace kvsim {

// Fills delta_ppl of every record and appends one note per target. The text must split into the
// trace's sequences: each held-out sequence must tokenize to the tokens the trace stores.
void confirm_in_the_loop(SearchOutcome& outcome, const SearchSpec& spec, const ModelInput& input,
                         const std::string& config_file, bool show_progress);

// fit: mixed with the model: per target, which of the mixes (every family's, each pair's) the
// profile carries, chosen by the model's own rise in perplexity on the fitting sequences (the
// held-out ones stay unseen); the proxy ranks heads within a mix, the model the mixes. Switches
// writes_profile and the target's mixed profile to the chosen record and appends one note per
// target. Nothing to do without a mixed fit.
void choose_mix_in_the_loop(SearchOutcome& outcome, const SearchSpec& spec, const ModelInput& input,
                            const std::string& config_file, bool show_progress);

// What confirm_in_the_loop needs, checked before the search runs rather than after it: the model
// loads, its shape is the trace's, and the held-out sequences tokenize to the trace's tokens.
// Throws the InputError confirm_in_the_loop would, without the hours of search before it. The
// model is released again: a search's replay does not hold a model's weights beside its own.
void check_confirmation_input(const SearchSpec& spec, const std::string& trace_path, const ModelInput& input);

}  // namespace kvsim
