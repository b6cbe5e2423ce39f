// StreamingLLM: Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks"
// (ICLR), as NVIDIA kvpress's StreamingLLMPress applies it to a prompt: the first n_sink
// positions and the newest of the rest stay. Scored by position, newest highest, the sinks above
// all, so that keeping the highest scores keeps exactly those.
#include <stdexcept>
#include <string>

#include "policies/prompt_press.h"

namespace kvsim {
namespace {

class StreamingLlmPress : public PromptPress {
public:
    StreamingLlmPress(int capacity, int sinks) : PromptPress(capacity), sinks_(sinks) {}

protected:
    void score(const PromptView& p, std::vector<double>& scores) override {
        if (p.length <= sinks_)
            throw std::logic_error("a prompt of " + std::to_string(p.length) + " tokens is not longer than n_sink " +
                                   std::to_string(sinks_) + " (kvpress refuses it too)");
        for (int64_t j = 0; j < p.length; ++j)
            scores[j] = j < sinks_ ? static_cast<double>(2 * p.length - j) : static_cast<double>(j);
    }

private:
    int sinks_;
};

}  // namespace

PolicyDescriptor streaming_llm_press_descriptor() {
    return prompt_press_descriptor("streaming_llm_press",
                                   "Xiao et al. 2024, Efficient Streaming Language Models with Attention Sinks (ICLR), "
                                   "as kvpress's StreamingLLMPress compresses a prompt",
                                   {{"n_sink", 4, true, 0, "first positions always kept"}},
                                   [](const ParamValues& p, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
                                       return std::make_unique<StreamingLlmPress>(ctx.capacity, param_int(p, "n_sink"));
                                   });
}

}  // namespace kvsim
