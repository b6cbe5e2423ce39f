#include "sim/attention_source.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <stdexcept>

#include "sim/qkv_attention.h"
#include "base/errors.h"
#include "base/size_limits.h"

namespace kvsim {
namespace {

class PolicybookSource : public AttentionSource {
public:
    PolicybookSource(const PolicybookTraceSpec& spec, int64_t max_steps) : spec_(spec), generator_(spec) {
        shape_.sequence_names = {spec.name};
        shape_.sequence_lengths = {spec.sequence_length};
        shape_.last_steps = {last_replayed_step(spec.sequence_length, max_steps)};
    }
    const AttentionShape& shape() const override { return shape_; }
    std::string description() const override { return "policybook/" + spec_.name + " (generated in-process)"; }
    // Generated rows are replayed once: 256 KB blocks stay in cache, where the default 16 MB block
    // cost the whole `kvsim run configs/policybook.yaml` 4,000 page faults and a third of its time.
    int64_t block_floats(int64_t wanted) const override { return std::min<int64_t>(wanted, int64_t{1} << 16); }

    void read_block(int sequence, int layer, int64_t first_step, int64_t end_step, AttentionBlock& block) override {
        // The generator is a single sequential stream: blocks must be asked for in order.
        if (sequence != 0 || layer != 0 || first_step != generator_.next_step())
            throw std::logic_error("policybook rows must be read in order");
        block.first_step = first_step;
        block.end_step = end_step;
        block.rows.resize(1);
        block.rows[0].resize(attention_row_offset(end_step) - attention_row_offset(first_step));
        float* row = block.rows[0].data();
        for (int64_t t = first_step; t < end_step; ++t) {
            generator_.next_row({row, static_cast<std::size_t>(t)});
            row += t;
        }
        block.self_weight.clear();  // derived from the rows, only where a view needs it
    }

private:
    PolicybookTraceSpec spec_;
    PolicybookGenerator generator_;
    AttentionShape shape_;
};

class AttentionFileSource : public AttentionSource {
public:
    AttentionFileSource(std::unique_ptr<TraceReader> reader, int64_t max_steps, const std::vector<int>& sequences)
        : reader_(std::move(reader)), shape_(trace_shape(*reader_, max_steps, sequences)),
          file_index_(selected_sequences(*reader_, sequences)) {}
    const AttentionShape& shape() const override { return shape_; }
    std::string description() const override { return reader_->path(); }
    void read_block(int sequence, int layer, int64_t first_step, int64_t end_step, AttentionBlock& block) override {
        block.first_step = first_step;
        block.end_step = end_step;
        block.rows.resize(shape_.num_query_heads);
        for (int head = 0; head < shape_.num_query_heads; ++head)
            reader_->read_attention_rows(file_index_.at(sequence), layer, head, first_step, end_step, block.rows[head]);
        block.self_weight.clear();
    }

private:
    std::unique_ptr<TraceReader> reader_;
    AttentionShape shape_;
    std::vector<int> file_index_;
};

}  // namespace

int64_t last_replayed_step(int64_t length, int64_t max_steps) {
    return max_steps > 0 ? std::min(length - 1, max_steps) : length - 1;
}

std::vector<int> selected_sequences(const TraceReader& reader, const std::vector<int>& sequences) {
    const int count = static_cast<int>(reader.sequences().size());
    for (int s : sequences)
        if (s < 0 || s >= count)
            throw InputError(reader.path() + ": no sequence " + std::to_string(s) + " (it has " + std::to_string(count) +
                             ", numbered from 0)");
    if (!sequences.empty()) return sequences;
    std::vector<int> all(count);
    for (int s = 0; s < count; ++s) all[s] = s;
    return all;
}

AttentionShape trace_shape(const TraceReader& reader, int64_t max_steps, const std::vector<int>& sequences) {
    const TraceMetadata& m = reader.metadata();
    AttentionShape shape;
    // The reader range-checks these; narrowing is checked again here, where it happens.
    shape.num_layers = checked_narrow<int>(m.num_layers, reader.path() + ": root attribute 'num_layers'");
    shape.num_query_heads = checked_narrow<int>(m.num_query_heads, reader.path() + ": root attribute 'num_query_heads'");
    shape.num_kv_heads = checked_narrow<int>(m.num_kv_heads, reader.path() + ": root attribute 'num_kv_heads'");
    for (int index : selected_sequences(reader, sequences)) {
        const SequenceInfo& s = reader.sequences()[index];
        shape.sequence_names.push_back(s.name);
        shape.sequence_lengths.push_back(s.length);
        shape.last_steps.push_back(last_replayed_step(s.length, max_steps));
    }
    return shape;
}

void self_weight_from_row_sums(AttentionBlock& block) {
    const std::size_t heads = block.rows.size();
    const int64_t rows = block.end_step - block.first_step;
    block.self_weight.assign(heads, std::vector<float>(rows));
    tbb::parallel_for(int64_t{0}, static_cast<int64_t>(heads) * rows, [&](int64_t job) {
        const int head = static_cast<int>(job / rows);
        const int64_t i = job % rows, t = block.first_step + i;
        const float* row = block.row(head, t);
        double sum = 0.0;
        for (int64_t j = 0; j < t; ++j) sum += row[j];
        block.self_weight[head][i] = static_cast<float>(std::max(0.0, 1.0 - sum));
    });
}

std::unique_ptr<AttentionSource> make_policybook_source(const PolicybookTraceSpec& spec, int64_t max_steps) {
    return std::make_unique<PolicybookSource>(spec, max_steps);
}

std::unique_ptr<AttentionSource> open_trace_source(const std::string& path, int64_t max_steps,
                                                   const std::vector<int>& sequences) {
    auto reader = std::make_unique<TraceReader>(path);
    if (reader->metadata().kind == TraceKind::qkv) return make_qkv_source(std::move(reader), max_steps, sequences);
    return std::make_unique<AttentionFileSource>(std::move(reader), max_steps, sequences);
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
