#include "sim/attention_source.h"

#include <algorithm>
#include <stdexcept>

#include "src/errors.h"

namespace kvsim {
namespace {

int64_t last_step(int64_t length, int64_t max_steps) {
    return max_steps > 0 ? std::min(length - 1, max_steps) : length - 1;
}

class PolicybookSource : public AttentionSource {
public:
    PolicybookSource(const PolicybookTraceSpec& spec, int64_t max_steps) : spec_(spec), generator_(spec) {
        shape_.sequence_names = {spec.name};
        shape_.sequence_lengths = {spec.sequence_length};
        shape_.last_steps = {last_step(spec.sequence_length, max_steps)};
    }
    const AttentionShape& shape() const override { return shape_; }
    std::string description() const override { return "policybook/" + spec_.name + " (generated in-process)"; }

    void read_rows(int sequence, int layer, int head, int64_t first_step, int64_t end_step,
                   std::vector<float>& out) override {
        // The generator is a single sequential stream: rows must be asked for in order.
        if (sequence != 0 || layer != 0 || head != 0 || first_step != generator_.next_step())
            throw std::logic_error("policybook rows must be read in order");
        out.resize(attention_row_offset(end_step) - attention_row_offset(first_step));
        float* row = out.data();
        for (int64_t t = first_step; t < end_step; ++t) {
            generator_.next_row({row, static_cast<std::size_t>(t)});
            row += t;
        }
    }

private:
    PolicybookTraceSpec spec_;
    PolicybookGenerator generator_;
    AttentionShape shape_;
};

class TraceFileSource : public AttentionSource {
public:
    TraceFileSource(const std::string& path, int64_t max_steps) : reader_(path) {
        const TraceMetadata& m = reader_.metadata();
        if (m.kind != TraceKind::attention)
            throw InputError(path + ": a " + std::string(to_string(m.kind)) +
                             " trace; this replay reads attention traces (root attribute 'kind')");
        shape_.num_layers = static_cast<int>(m.num_layers);
        shape_.num_heads = static_cast<int>(m.num_query_heads);
        for (const SequenceInfo& s : reader_.sequences()) {
            shape_.sequence_names.push_back(s.name);
            shape_.sequence_lengths.push_back(s.length);
            shape_.last_steps.push_back(last_step(s.length, max_steps));
        }
    }
    const AttentionShape& shape() const override { return shape_; }
    std::string description() const override { return reader_.path(); }
    void read_rows(int sequence, int layer, int head, int64_t first_step, int64_t end_step,
                   std::vector<float>& out) override {
        reader_.read_attention_rows(sequence, layer, head, first_step, end_step, out);
    }

private:
    TraceReader reader_;
    AttentionShape shape_;
};

}  // namespace

std::unique_ptr<AttentionSource> make_policybook_source(const PolicybookTraceSpec& spec, int64_t max_steps) {
    return std::make_unique<PolicybookSource>(spec, max_steps);
}

std::unique_ptr<AttentionSource> open_attention_trace(const std::string& path, int64_t max_steps) {
    return std::make_unique<TraceFileSource>(path, max_steps);
}

void write_policybook_trace(const PolicybookTraceSpec& spec, const std::string& path) {
    TraceMetadata metadata;
    metadata.kind = TraceKind::attention;
    metadata.model_name = "policybook synthetic (sinks + local band + heavy hitters + noise)";
    metadata.source_kind = "synthetic";
    metadata.source_generator = "policybook/" + spec.name;
    metadata.source_seed = spec.seed;
    TraceWriter writer(path, metadata);
    const int sequence = writer.add_sequence(spec.name, spec.sequence_length);
    PolicybookGenerator generator(spec);
    // Write in blocks of rows, so memory stays bounded for long sequences too.
    std::vector<float> block;
    int64_t first = 1;
    while (first <= generator.last_step()) {
        const int64_t end = attention_block_end(first, generator.last_step(), 1 << 20);
        block.resize(attention_row_offset(end) - attention_row_offset(first));
        float* row = block.data();
        for (int64_t t = first; t < end; ++t) {
            generator.next_row({row, static_cast<std::size_t>(t)});
            row += t;
        }
        writer.write_attention_rows(sequence, 0, 0, first, block);
        first = end;
    }
    writer.commit();
}

}  // namespace kvsim
