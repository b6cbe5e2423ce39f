#include "src/shards.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "base/input_file.h"
#include "base/json_file.h"
#include "base/output_folder.h"
#include "base/sha256.h"
#include "kvsim_version.h"
#include "search/tier_fit.h"
#include "src/report.h"

namespace kvsim {
namespace {

using Json = nlohmann::ordered_json;
constexpr int kPartialFormat = 3;  // 2: frame_sha256; 3: a stream's output_error_variance

Json stream_json(const StreamMetrics& m) {
    return Json::array({m.retained_mass, m.steps, m.heavy_hitter_hits, m.heavy_hitter_possible, m.eviction_calls,
                        m.output_rel_error, m.output_cosine, m.output_steps, m.cache_bytes, m.fp16_bytes,
                        m.context_tokens, m.output_error_variance});
}

Json frame_json(const ResultFrame& f) {
    Json cells = Json::array();
    for (const CellInfo& c : f.cells) {
        Json params = Json::object();
        for (const auto& [name, value] : c.params) params[name] = value;
        cells.push_back(Json{{"policy", c.policy},
                         {"label", c.label},
                         {"params", params},
                         {"keeps_everything", c.keeps_everything},
                         {"compression", c.compression},
                         {"budget", c.budget},
                         {"budget_label", c.budget_label},
                         {"layer_budgets", c.layer_budgets}});
    }
    return {{"trace", f.trace},
            {"metrics", f.metrics},
            {"note", f.note},
            {"per_layer", f.per_layer},
            {"per_sequence", f.per_sequence},
            {"num_layers", f.num_layers},
            {"num_kv_heads", f.num_kv_heads},
            {"group_size", f.group_size},
            {"sequence_lengths", f.sequence_lengths},
            {"sequence_names", f.sequence_names},
            {"sequence_index", f.sequence_index},
            {"cells", cells}};
}

// What every partial file, a sweep's or a search's, says of itself: who wrote it, for which config
// and trace, which share of how many units, and whether that share is finished.
struct PartialHeader {
    std::string path;
    std::string kvsim_version, config_sha256, trace_sha256;
    std::string config_path;  // a search's (its merge reads the config again); empty for a sweep
    ShardSpec shard;
    std::size_t units = 0, first = 0, end = 0;  // units in the run; this shard's range
    bool complete = false;
};

void write_identity(Json& j, const PartialHeader& p) {
    j["kvsim_version"] = p.kvsim_version;
    j["config_sha256"] = p.config_sha256;
    j["trace_sha256"] = p.trace_sha256;
}

void write_range(Json& j, const PartialHeader& p) {
    j["shard"] = p.shard.index;
    j["shards"] = p.shard.count;
    j["units"] = p.units;
    j["first_unit"] = p.first;
    j["end_unit"] = p.end;
    j["complete"] = p.complete;
}

// Reads a partial file (a shard's results, a --resume checkpoint) with one error line per problem:
// the file, the field as a path into the JSON (results[3].streams[0].retained_mass), and what is
// wrong, in kvsim's words. Every number is checked against the range the rest of the file implies
// before anything is sized by it or summed.
class PartialReader {
public:
    PartialReader(std::string path, std::string kind) : path_(std::move(path)), kind_(std::move(kind)) {}
    const std::string& path() const { return path_; }

    [[noreturn]] void fail(const std::string& field, const std::string& problem) const {
        throw InputError(path_ + ": not a valid " + kind_ + ": " + field + ": " + problem);
    }
    const Json& at(const Json& object, const std::string& field, const std::string& name) const {
        const std::string key = field.empty() ? name : field + "." + name;
        if (!object.is_object()) fail(field.empty() ? "(top level)" : field, "expected an object");
        const auto it = object.find(name);
        if (it == object.end()) fail(key, "missing");
        return *it;
    }
    int64_t integer(const Json& j, const std::string& field, int64_t lo, int64_t hi) const {
        if (!j.is_number_integer()) fail(field, "expected a whole number, got " + shown(j));
        const bool above = j.is_number_unsigned() ? j.get<uint64_t>() > static_cast<uint64_t>(hi) : j.get<int64_t>() > hi;
        if (above || j.get<int64_t>() < lo)
            fail(field, shown(j) + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
        return j.get<int64_t>();
    }
    // A number in [lo, hi]; null (a non-finite value, as the writer writes one) reads as NaN where
    // `null_is_nan`.
    double number(const Json& j, const std::string& field, double lo, double hi, bool null_is_nan = false) const {
        if (j.is_null() && null_is_nan) return NAN;
        if (!j.is_number()) fail(field, "expected a number, got " + shown(j));
        const double v = j.get<double>();
        if (!(v >= lo && v <= hi)) fail(field, shown(j) + " is outside [" + text(lo) + ", " + text(hi) + "]");
        return v;
    }
    std::string string(const Json& j, const std::string& field) const {
        if (!j.is_string()) fail(field, "expected a string, got " + shown(j));
        return j.get<std::string>();
    }
    std::string sha256(const Json& j, const std::string& field) const {
        const std::string hex = string(j, field);
        if (hex.size() != 64 || hex.find_first_not_of("0123456789abcdef") != std::string::npos)
            fail(field, "expected 64 lowercase hexadecimal digits (a sha256)");
        return hex;
    }
    bool boolean(const Json& j, const std::string& field) const {
        if (!j.is_boolean()) fail(field, "expected true or false, got " + shown(j));
        return j.get<bool>();
    }
    const Json& list(const Json& j, const std::string& field, std::size_t most) const {
        if (!j.is_array()) fail(field, "expected a list");
        if (j.size() > most) fail(field, std::to_string(j.size()) + " entries, more than the " + std::to_string(most) +
                                             " the file allows");
        return j;
    }
    // A list of exactly `size` entries; `what` names them in the message ("the 12 numbers of a stream").
    const Json& exactly(const Json& j, const std::string& field, std::size_t size, const std::string& what) const {
        list(j, field, size);
        if (j.size() != size) fail(field, std::to_string(j.size()) + " entries, expected " + what);
        return j;
    }
    std::vector<std::string> strings(const Json& j, const std::string& field, std::size_t size) const {
        exactly(j, field, size, std::to_string(size));
        std::vector<std::string> out;
        for (std::size_t i = 0; i < j.size(); ++i) out.push_back(string(j[i], field + "[" + std::to_string(i) + "]"));
        return out;
    }

    static std::string text(double x) {
        char out[32];
        std::snprintf(out, sizeof out, "%.10g", x);
        return out;
    }
    // A value as the file has it, cut short: the error stays one readable line.
    static std::string shown(const Json& j) {
        std::string out = to_json_text(j);
        if (out.size() > 40) out = out.substr(0, 37) + "...";
        for (char& c : out)
            if (static_cast<unsigned char>(c) < 0x20) c = ' ';
        return out;
    }

private:
    std::string path_, kind_;
};

constexpr int64_t kMaxShape = 1 << 16;  // layers, KV heads, query heads per KV head, as the trace reader allows

// a * b for bounds, at most 2^62 (never wrapping).
int64_t bound_product(int64_t a, int64_t b) {
    constexpr int64_t most = int64_t{1} << 62;
    return a > 0 && b > most / a ? most : a * b;
}

// One stream's sums (StreamMetrics, as stream_json writes them) against what they can be: `steps`
// query-head decode steps of a sequence of `length` tokens (0: not known, a search's fitting
// sequence) in groups of `group`; fractions summed per step at most the steps (rounding allows
// 1e-6 more), hits at most the possible ones, one eviction call per KV head and step at most.
StreamMetrics read_stream(const PartialReader& r, const Json& j, const std::string& field, int64_t length, int group) {
    r.exactly(j, field, 12, "the 12 numbers of a stream");
    const auto at = [&](int i, const char* name) { return field + "[" + std::to_string(i) + "] (" + name + ")"; };
    const int64_t most_steps = length > 0 ? bound_product(group, length - 1) : int64_t{1} << 50;
    StreamMetrics m;
    m.steps = r.integer(j[1], at(1, "steps"), length == 1 ? 0 : group, most_steps);
    if (m.steps % group != 0)
        r.fail(at(1, "steps"), std::to_string(m.steps) + " is not a multiple of the " + std::to_string(group) +
                                   " query heads per KV head");
    const double steps = static_cast<double>(m.steps);
    const double fraction_sum = steps * (1 + 1e-6);
    const int64_t decode_steps = m.steps / group;
    const int64_t positions = length > 0 ? length : int64_t{1} << 40;
    m.retained_mass = r.number(j[0], at(0, "retained_mass"), 0, fraction_sum, true);
    m.heavy_hitter_possible =
        r.integer(j[3], at(3, "heavy_hitter_possible"), 0, bound_product(m.steps, positions));
    m.heavy_hitter_hits = r.integer(j[2], at(2, "heavy_hitter_hits"), 0, m.heavy_hitter_possible);
    m.eviction_calls = r.integer(j[4], at(4, "eviction_calls"), 0, decode_steps);
    m.output_steps = r.integer(j[7], at(7, "output_steps"), 0, m.steps);
    const double output_sum = static_cast<double>(m.output_steps) * (1 + 1e-6);
    m.output_rel_error = r.number(j[5], at(5, "output_rel_error"), 0, m.output_steps ? 1e300 : 0, true);
    m.output_cosine = r.number(j[6], at(6, "output_cosine"), -output_sum, output_sum, true);
    m.context_tokens =
        r.integer(j[10], at(10, "context_tokens"), 0, bound_product(decode_steps, positions));
    m.cache_bytes = r.number(j[8], at(8, "cache_bytes"), 0, 1e300, true);
    m.fp16_bytes = r.number(j[9], at(9, "fp16_bytes"), 0, 1e300, true);
    m.output_error_variance = r.number(j[11], at(11, "output_error_variance"), 0, m.output_steps ? 1e300 : 0, true);
    return m;
}

// The streams of every unit replay the same steps of a sequence, whatever the policy, layer or KV
// head: a file (or a merge) whose streams disagree was edited.
class StepsPerSequence {
public:
    void check(const PartialReader& r, const std::string& field, std::size_t sequence, int64_t steps) {
        if (steps_.size() <= sequence) steps_.resize(sequence + 1, -1);
        if (steps_[sequence] < 0) {
            steps_[sequence] = steps;
            where_[sequence] = r.path() + ": " + field;
        } else if (steps_[sequence] != steps) {
            r.fail(field, std::to_string(steps) + " steps, but " + where_[sequence] + " has " +
                              std::to_string(steps_[sequence]) + " for the same sequence");
        }
    }

private:
    std::vector<int64_t> steps_;
    std::map<std::size_t, std::string> where_;
};

ResultFrame read_frame(const PartialReader& r, const Json& j) {
    ResultFrame f;
    f.trace = r.string(r.at(j, "frame", "trace"), "frame.trace");
    f.metrics = r.strings(r.list(r.at(j, "frame", "metrics"), "frame.metrics", 64), "frame.metrics",
                          r.at(j, "frame", "metrics").size());
    f.note = r.string(r.at(j, "frame", "note"), "frame.note");
    f.per_layer = r.boolean(r.at(j, "frame", "per_layer"), "frame.per_layer");
    f.per_sequence = r.boolean(r.at(j, "frame", "per_sequence"), "frame.per_sequence");
    f.num_layers = static_cast<int>(r.integer(r.at(j, "frame", "num_layers"), "frame.num_layers", 1, kMaxShape));
    f.num_kv_heads = static_cast<int>(r.integer(r.at(j, "frame", "num_kv_heads"), "frame.num_kv_heads", 1, kMaxShape));
    f.group_size = static_cast<int>(r.integer(r.at(j, "frame", "group_size"), "frame.group_size", 1, kMaxShape));
    const Json& lengths = r.list(r.at(j, "frame", "sequence_lengths"), "frame.sequence_lengths", 1 << 20);
    if (lengths.empty()) r.fail("frame.sequence_lengths", "empty");
    for (std::size_t s = 0; s < lengths.size(); ++s)
        f.sequence_lengths.push_back(
            r.integer(lengths[s], "frame.sequence_lengths[" + std::to_string(s) + "]", 1, kMaxSequenceTokens));
    const std::size_t sequences = f.sequence_lengths.size();
    f.sequence_names = r.strings(r.at(j, "frame", "sequence_names"), "frame.sequence_names", sequences);
    const Json& index =
        r.exactly(r.at(j, "frame", "sequence_index"), "frame.sequence_index", sequences, std::to_string(sequences));
    for (std::size_t s = 0; s < sequences; ++s) {
        const std::string field = "frame.sequence_index[" + std::to_string(s) + "]";
        f.sequence_index.push_back(static_cast<int>(r.integer(index[s], field, 0, kMaxSequenceTokens)));
        if (std::find(f.sequence_index.begin(), f.sequence_index.end() - 1, f.sequence_index.back()) !=
            f.sequence_index.end() - 1)
            r.fail(field, "sequence " + std::to_string(f.sequence_index.back()) + " is listed twice");
    }
    const Json& cells = r.list(r.at(j, "frame", "cells"), "frame.cells", 1 << 20);
    if (cells.empty()) r.fail("frame.cells", "empty");
    for (std::size_t i = 0; i < cells.size(); ++i) {
        const std::string field = "frame.cells[" + std::to_string(i) + "]";
        const Json& c = cells[i];
        CellInfo cell;
        cell.policy = r.string(r.at(c, field, "policy"), field + ".policy");
        cell.label = r.string(r.at(c, field, "label"), field + ".label");
        const Json& params = r.at(c, field, "params");
        if (!params.is_object()) r.fail(field + ".params", "expected an object");
        for (const auto& [name, value] : params.items())
            cell.params[name] = r.number(value, field + ".params." + name, -1e300, 1e300);
        cell.keeps_everything = r.boolean(r.at(c, field, "keeps_everything"), field + ".keeps_everything");
        cell.compression = r.number(r.at(c, field, "compression"), field + ".compression", 0, 1e6);
        cell.budget = static_cast<int>(r.integer(r.at(c, field, "budget"), field + ".budget",
                                                 cell.keeps_everything || cell.compression > 0 ? 0 : 1,
                                                 kMaxBudgetTokens));
        cell.budget_label = r.string(r.at(c, field, "budget_label"), field + ".budget_label");
        const Json& layer_budgets = r.list(r.at(c, field, "layer_budgets"), field + ".layer_budgets", kMaxShape);
        if (!layer_budgets.empty() && layer_budgets.size() != static_cast<std::size_t>(f.num_layers))
            r.fail(field + ".layer_budgets", std::to_string(layer_budgets.size()) + " entries, but the frame has " +
                                                 std::to_string(f.num_layers) + " layers");
        for (std::size_t l = 0; l < layer_budgets.size(); ++l)
            cell.layer_budgets.push_back(static_cast<int>(r.integer(
                layer_budgets[l], field + ".layer_budgets[" + std::to_string(l) + "]", 1, kMaxBudgetTokens)));
        f.cells.push_back(std::move(cell));
    }
    // What a merge allocates for it: every (cell, sequence, layer, KV head)'s sums.
    const uint64_t streams = checked_mul(checked_mul(f.cells.size(), sequences, "frame"),
                                         checked_mul(f.num_layers, f.num_kv_heads, "frame"), "frame");
    check_memory(checked_mul(streams, 2 * sizeof(StreamMetrics), "frame"),
                 r.path() + ": frame (" + std::to_string(f.cells.size()) + " cells x " + std::to_string(sequences) +
                     " sequences x " + std::to_string(f.num_layers) + " layers x " + std::to_string(f.num_kv_heads) +
                     " KV heads)");
    return f;
}

void read_identity(const PartialReader& r, const Json& j, PartialHeader& p) {
    p.kvsim_version = r.string(r.at(j, "", "kvsim_version"), "kvsim_version");
    p.config_sha256 = r.sha256(r.at(j, "", "config_sha256"), "config_sha256");
    p.trace_sha256 = r.sha256(r.at(j, "", "trace_sha256"), "trace_sha256");
}

// The shard and its range, which must be the shard's share of `units`, the count the rest of the
// file implies.
void read_range(const PartialReader& r, const Json& j, PartialHeader& p, std::size_t units) {
    p.shard.count = static_cast<int>(r.integer(r.at(j, "", "shards"), "shards", 1, 1000000));
    p.shard.index = static_cast<int>(r.integer(r.at(j, "", "shard"), "shard", 0, p.shard.count - 1));
    p.units = static_cast<std::size_t>(r.integer(r.at(j, "", "units"), "units", 0, int64_t{1} << 40));
    if (p.units != units)
        r.fail("units", std::to_string(p.units) + ", but the rest of the file implies " + std::to_string(units));
    if (p.units < static_cast<std::size_t>(p.shard.count))
        r.fail("shards", std::to_string(p.shard.count) + " shards of " + std::to_string(p.units) + " units");
    const auto [first, end] = shard_range(p.units, p.shard);
    p.first = static_cast<std::size_t>(r.integer(r.at(j, "", "first_unit"), "first_unit", 0, int64_t{1} << 40));
    p.end = static_cast<std::size_t>(r.integer(r.at(j, "", "end_unit"), "end_unit", 0, int64_t{1} << 40));
    if (p.first != first || p.end != end)
        r.fail("first_unit", "units [" + std::to_string(p.first) + ", " + std::to_string(p.end) + "), but shard " +
                                 p.shard.text() + " of " + std::to_string(p.units) + " units is [" +
                                 std::to_string(first) + ", " + std::to_string(end) + ")");
    p.complete = r.boolean(r.at(j, "", "complete"), "complete");
}

// A result's unit: inside the shard's range and not seen before in the file.
template <class Done>
std::size_t read_unit(const PartialReader& r, const Json& result, const std::string& field, const PartialHeader& p,
                      const Done& done) {
    const auto unit = static_cast<std::size_t>(r.integer(r.at(result, field, "unit"), field + ".unit", 0, int64_t{1} << 40));
    if (unit < p.first || unit >= p.end)
        r.fail(field + ".unit", std::to_string(unit) + " is outside the shard's units [" + std::to_string(p.first) +
                                    ", " + std::to_string(p.end) + ")");
    if (done.count(unit)) r.fail(field + ".unit", std::to_string(unit) + " is listed twice");
    return unit;
}

// --resume: the checkpoint must be this run's (same kvsim, trace and config).
void refuse_other_run(const PartialHeader& previous, const PartialHeader& now) {
    auto refuse = [&](const std::string& what, const std::string& was, const std::string& is) {
        throw InputError(now.path + ": written for another " + what + " (" + was + ", now " + is +
                         "); run without --resume to start this shard over");
    };
    if (previous.kvsim_version != now.kvsim_version) refuse("kvsim version", previous.kvsim_version, now.kvsim_version);
    if (previous.trace_sha256 != now.trace_sha256)
        refuse("trace", "trace_sha256 " + previous.trace_sha256, now.trace_sha256);
    if (previous.config_sha256 != now.config_sha256)
        refuse("config", "config_sha256 " + previous.config_sha256, now.config_sha256);
}

// merge: each partial of the same run as the first.
void refuse_different_runs(const PartialHeader& p, const PartialHeader& first) {
    auto differ = [&](const std::string& what, const std::string& a, const std::string& b) {
        throw InputError(p.path + ": " + what + " " + b + " differs from " + first.path + "'s " + a +
                         ": partials of different runs cannot merge");
    };
    if (p.kvsim_version != first.kvsim_version) differ("kvsim version", first.kvsim_version, p.kvsim_version);
    // The trace first: a different trace also changes the cells' description, and so the config's hash.
    if (p.trace_sha256 != first.trace_sha256) differ("trace_sha256", first.trace_sha256, p.trace_sha256);
    if (p.config_path != first.config_path) differ("config", first.config_path, p.config_path);
    if (p.config_sha256 != first.config_sha256) differ("config_sha256", first.config_sha256, p.config_sha256);
    if (p.shard.count != first.shard.count)
        differ("shard count", std::to_string(first.shard.count), std::to_string(p.shard.count));
}

// The checkpoint of a shard: its partial file, rewritten whole under a temporary name after every
// layer, in a folder the caller holds (OutputFolder, which removes a folder it made when nothing
// was written into it). Bad input found mid-way (a non-finite value in a later layer) is found
// again on a resume, so a failed run removes a checkpoint it started (not one it was resuming). A
// killed run never gets to abandon(), and its checkpoint stays.
class Checkpoint {
public:
    Checkpoint(std::string path, bool resuming) : path_(std::move(path)), resuming_(resuming) {}
    void write(const std::string& text) {
        write_file_atomically(path_, text);
        wrote_ = true;
    }
    void abandon() {
        std::error_code ec;
        if (wrote_ && !resuming_) std::filesystem::remove(path_, ec);
    }

private:
    std::string path_;
    bool resuming_, wrote_ = false;
};

// The units of the shard's range a checkpoint does not already hold.
template <class Done>
std::vector<std::size_t> unfinished_units(const PartialHeader& p, const Done& done) {
    std::vector<std::size_t> todo;
    for (std::size_t u = p.first; u < p.end; ++u)
        if (!done.count(u)) todo.push_back(u);
    return todo;
}

// The config's sha256: its file's bytes, then what else the results depend on.
std::string config_sha256_of(const std::string& config_path, const std::string& rest) {
    Sha256 hash;
    const std::string config = read_input_file(config_path);
    hash.update(config.data(), config.size());
    hash.update(rest.data(), rest.size());
    return hash.hex_digest();
}

// A partial results file: its header, and for a sweep its table settings, cells and units' results.
struct Partial : PartialHeader {
    std::string title, format, layout;
    ResultFrame frame;
    Json frame_text;  // as written, to compare partials
    std::map<std::size_t, UnitResult> done;
};

// The sha256 of a frame as the partial writes it: a frame edited without it is refused.
std::string frame_sha256(const Json& frame) { return sha256_hex(to_json_text(frame)); }

std::string partial_text(const Partial& p) {
    Json results = Json::array();
    const std::vector<WorkUnit> all = enumerate_work(p.frame.cells.size(), p.frame.num_layers);
    for (const auto& [unit, r] : p.done) {
        Json streams = Json::array();
        for (const StreamMetrics& m : r.streams) streams.push_back(stream_json(m));
        results.push_back(Json{{"unit", unit},
                           {"cell", all.at(unit).cell},
                           {"layer", all.at(unit).layer},
                           {"policy_bytes_per_slot", r.policy_bytes_per_slot},
                           {"streams", streams}});
    }
    Json j = {{"kvsim_partial_results", kPartialFormat}};
    write_identity(j, p);
    j["title"] = p.title;
    j["format"] = p.format;
    j["layout"] = p.layout;
    write_range(j, p);
    j["frame"] = p.frame_text;
    j["frame_sha256"] = frame_sha256(p.frame_text);
    j["results"] = results;
    return to_json_text(j) + "\n";
}

Partial read_partial(const std::string& path) {
    const Json j = load_ordered_json_file(path);
    const PartialReader r(path, "kvsim partial results file");
    Partial p;
    p.path = path;
    if (r.integer(r.at(j, "", "kvsim_partial_results"), "kvsim_partial_results", 0, 1 << 30) != kPartialFormat)
        r.fail("kvsim_partial_results", "format " + PartialReader::shown(j["kvsim_partial_results"]) +
                                            " is not the one this kvsim reads (" + std::to_string(kPartialFormat) + ")");
    read_identity(r, j, p);
    p.title = r.string(r.at(j, "", "title"), "title");
    p.format = r.string(r.at(j, "", "format"), "format");
    if (p.format != "table" && p.format != "csv" && p.format != "json") r.fail("format", "expected table, csv or json");
    p.layout = r.string(r.at(j, "", "layout"), "layout");
    if (p.layout != "matrix" && p.layout != "comparison") r.fail("layout", "expected matrix or comparison");
    p.frame_text = r.at(j, "", "frame");
    const std::string frame_hash = r.sha256(r.at(j, "", "frame_sha256"), "frame_sha256");
    if (frame_sha256(p.frame_text) != frame_hash)
        r.fail("frame", "does not match frame_sha256 (its cells, budgets or shape were edited)");
    p.frame = read_frame(r, p.frame_text);
    const ResultFrame& f = p.frame;
    read_range(r, j, p, f.cells.size() * static_cast<std::size_t>(f.num_layers));
    const std::size_t kv_heads = static_cast<std::size_t>(f.num_kv_heads);
    const std::size_t streams = f.sequence_lengths.size() * kv_heads;
    const Json& results = r.list(r.at(j, "", "results"), "results", p.end - p.first);
    StepsPerSequence steps;
    for (std::size_t i = 0; i < results.size(); ++i) {
        const std::string field = "results[" + std::to_string(i) + "]";
        const std::size_t unit = read_unit(r, results[i], field, p, p.done);
        UnitResult result;
        result.policy_bytes_per_slot = static_cast<std::size_t>(
            r.integer(r.at(results[i], field, "policy_bytes_per_slot"), field + ".policy_bytes_per_slot", 0, 1 << 20));
        const Json& list = r.exactly(r.at(results[i], field, "streams"), field + ".streams", streams,
                                     "one stream per (sequence, KV head): " + std::to_string(streams));
        for (std::size_t k = 0; k < streams; ++k) {
            const std::string at = field + ".streams[" + std::to_string(k) + "]";
            const std::size_t sequence = k / kv_heads;
            result.streams.push_back(read_stream(r, list[k], at, f.sequence_lengths[sequence], f.group_size));
            steps.check(r, at + "[1] (steps)", sequence, result.streams.back().steps);
        }
        p.done[unit] = std::move(result);
    }
    if (p.complete && p.done.size() != p.end - p.first)
        r.fail("complete", "true, but " + std::to_string(p.end - p.first - p.done.size()) + " of the shard's " +
                               std::to_string(p.end - p.first) + " units are missing");
    return p;
}

// What a partial's results depend on besides the trace: the config file's bytes and the flags
// that change the sweep, and the cells they expand to (which include any profile files' budgets).
std::string config_hash(const ShardedRun& run, const Json& frame) {
    std::string rest;
    for (const std::string& flag : run.identity) rest += '\0' + flag;
    rest += '\0' + frame.dump();
    return config_sha256_of(run.config_path, rest);
}

// The trace file's sha256; for a synthetic trace, of what generates it (deterministic).
std::string trace_hash(const TraceRef& trace) {
    if (!trace.path.empty()) return sha256_file(trace.path);
    return sha256_hex("kvsim synthetic " + trace.synthetic + " " + trace.name + " max_steps " +
                      std::to_string(trace.max_steps));
}

// A trace's sha256, a read of the whole file (0.4 s for 680 MB), computed beside the work that
// follows and written into `into` where it is first needed: a checkpoint to resume, or the first
// one written. A failed read's error comes there.
class HashBeside {
public:
    HashBeside(std::function<std::string()> hash, std::string& into)
        : hashing_(std::async(std::launch::async, std::move(hash))), into_(into) {}
    void settle() {
        if (hashing_.valid()) into_ = hashing_.get();
    }

private:
    std::future<std::string> hashing_;
    std::string& into_;
};

}  // namespace

std::string partial_file_name(const ShardSpec& shard) {
    return "partial-" + std::to_string(shard.index) + "-of-" + std::to_string(shard.count) + ".json";
}

ShardedOutcome run_sharded(const ExperimentConfig& config, const std::vector<GridAxis>& axes, const ShardedRun& run) {
    Experiment experiment(config, axes);
    Partial partial;
    partial.kvsim_version = KVSIM_VERSION;
    partial.frame = experiment.frame();
    partial.frame_text = frame_json(partial.frame);
    partial.config_sha256 = config_hash(run, partial.frame_text);
    HashBeside trace_sha256([trace = config.trace] { return trace_hash(trace); }, partial.trace_sha256);
    partial.title = "kvsim " + run.command + " " + run.config_path + "  |  trace " + partial.frame.trace;
    partial.format = run.format;
    partial.layout = run.layout;
    partial.shard = run.shard.value_or(ShardSpec{});
    partial.units = experiment.unit_count();
    std::tie(partial.first, partial.end) = shard_range(partial.units, partial.shard);

    std::error_code ec;
    partial.path = run.out_dir + "/" + partial_file_name(partial.shard);
    ShardedOutcome outcome;
    outcome.units = partial.end - partial.first;
    outcome.partial_path = partial.path;
    // One writer of the folder at a time; the shards of a sweep share it, each writing its own
    // partial file.
    const OutputFolder folder(run.out_dir, run.shard ? OutputFolder::Access::shared : OutputFolder::Access::exclusive);
    if (run.resume && std::filesystem::exists(partial.path)) {
        Partial previous = read_partial(partial.path);
        trace_sha256.settle();
        refuse_other_run(previous, partial);
        partial.done = std::move(previous.done);
        outcome.units_resumed = partial.done.size();
    }

    const std::vector<std::size_t> todo = unfinished_units(partial, partial.done);
    outcome.units_run = todo.size();
    Checkpoint checkpoint(partial.path, !partial.done.empty());
    const auto start = std::chrono::steady_clock::now();
    try {
        experiment.run_units(todo, run.show_progress,
                             [&](const std::vector<std::size_t>& units, std::vector<UnitResult>& results) {
                                 for (std::size_t i = 0; i < units.size(); ++i)
                                     partial.done[units[i]] = std::move(results[i]);
                                 trace_sha256.settle();
                                 checkpoint.write(partial_text(partial));
                             });
    } catch (...) {
        checkpoint.abandon();
        throw;
    }
    partial.complete = true;
    if (run.shard) {
        trace_sha256.settle();
        checkpoint.write(partial_text(partial));
        return outcome;
    }
    // The rate printed counts the steps replayed now, not those a resumed checkpoint held.
    int64_t steps_now = 0;
    for (std::size_t u : todo)
        for (const StreamMetrics& m : partial.done.at(u).streams) steps_now += m.steps / partial.frame.group_size;
    std::vector<UnitResult> units;
    for (auto& [u, r] : partial.done) units.push_back(std::move(r));
    outcome.result = build_result(partial.frame, units);
    outcome.result->policy_steps = steps_now;
    outcome.result->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    write_outputs(*outcome.result, run.out_dir);
    std::filesystem::remove(partial.path, ec);  // the results are written: the checkpoint has served
    return outcome;
}

std::vector<std::string> partial_files(const std::vector<std::string>& inputs) {
    std::vector<std::string> files;
    for (const std::string& input : inputs) {
        std::error_code ec;
        if (std::filesystem::is_directory(input, ec)) {
            std::vector<std::string> found;
            for (const auto& entry : std::filesystem::directory_iterator(input, ec)) {
                const std::string name = entry.path().filename().string();
                if (name.rfind("partial-", 0) == 0 && name.size() > 5 && name.substr(name.size() - 5) == ".json")
                    found.push_back(entry.path().string());
            }
            if (ec) throw InputError(input + ": cannot list (" + ec.message() + ")");
            if (found.empty()) throw InputError(input + ": no partial results (partial-I-of-N.json) in this folder");
            std::sort(found.begin(), found.end());
            files.insert(files.end(), found.begin(), found.end());
        } else {
            files.push_back(input);
        }
    }
    return files;
}

namespace {

// Every shard present and complete, `done` holding each present shard's finished units: else an
// InputError naming the shards to rerun.
void refuse_missing_units(std::size_t units, int shards, const std::map<int, std::size_t>& done, const char* unit_name) {
    std::string missing;
    std::size_t missing_units = 0;
    for (int i = 0; i < shards; ++i) {
        const ShardSpec shard{i, shards};
        const auto [a, b] = shard_range(units, shard);
        const auto it = done.find(i);
        const std::size_t have = it == done.end() ? 0 : it->second;
        if (have == b - a) continue;
        missing_units += b - a - have;
        missing += (missing.empty() ? "" : ", ") + shard.text() +
                   (it == done.end() ? " (no " + partial_file_name(shard) + ")"
                                     : " (" + std::to_string(b - a - have) + " of " + std::to_string(b - a) +
                                           " units unfinished)");
    }
    if (!missing.empty())
        throw InputError("merge: " + std::to_string(missing_units) + " of " + std::to_string(units) + " units (" +
                         unit_name + ") missing; rerun with --resume: --shard " + missing);
}

// Each partial's units replay the same steps of each sequence (read_partial checked that within a
// file): partials whose steps differ are not of one run, however their headers agree.
template <class P, class StreamsOf>
void refuse_steps_differences(const std::vector<P>& partials, std::size_t kv_heads, StreamsOf streams_of) {
    const P* reference = nullptr;
    std::vector<int64_t> steps;
    for (const P& p : partials) {
        if (p.done.empty()) continue;
        const auto& streams = streams_of(p.done.begin()->second);
        std::vector<int64_t> mine;
        for (std::size_t k = 0; k < streams.size(); k += kv_heads) mine.push_back(streams[k].steps);
        if (!reference) {
            reference = &p;
            steps = mine;
            continue;
        }
        for (std::size_t s = 0; s < mine.size() && s < steps.size(); ++s)
            if (mine[s] != steps[s])
                throw InputError(p.path + ": the streams of sequence " + std::to_string(s) + " replay " +
                                 std::to_string(mine[s]) + " steps, and " + reference->path + "'s replay " +
                                 std::to_string(steps[s]) + ": partials of different runs cannot merge");
    }
}

}  // namespace

MergeOutcome merge_partials(const std::vector<std::string>& inputs) {
    const std::vector<std::string> files = partial_files(inputs);
    std::vector<Partial> partials;
    for (const std::string& f : files) partials.push_back(read_partial(f));

    const Partial& first = partials.front();
    std::map<int, const Partial*> by_shard;
    for (const Partial& p : partials) {
        refuse_different_runs(p, first);
        if (p.frame_text != first.frame_text)
            throw InputError(p.path + ": sweep cells differs from " + first.path +
                             "'s cells: partials of different runs cannot merge");
        const auto [it, inserted] = by_shard.emplace(p.shard.index, &p);
        if (!inserted)
            throw InputError(p.path + ": shard " + p.shard.text() + " also in " + it->second->path +
                             ": give each shard once");
    }
    std::map<int, std::size_t> done;
    for (const auto& [index, p] : by_shard) done[index] = p->done.size();
    refuse_missing_units(first.units, first.shard.count, done, "cell x layer");
    refuse_steps_differences(partials, static_cast<std::size_t>(first.frame.num_kv_heads),
                             [](const UnitResult& r) -> const std::vector<StreamMetrics>& { return r.streams; });

    std::vector<UnitResult> units(first.units);
    for (const Partial& p : partials)
        for (const auto& [u, r] : p.done) units[u] = r;
    MergeOutcome out;
    out.result = build_result(first.frame, units);
    out.title = first.title;
    out.format = first.format;
    out.layout = first.layout;
    out.shards = first.shard.count;
    out.units = first.units;
    return out;
}

// Search shards: a share of the search's work units (SearchShardWork), checkpointed as a sweep's
// shard is, and their merge, which runs the rest of the search as one machine would.
namespace {

// 2: a stream's output_error_variance; 3: tier and streaming units; 4: a screened tier fit's options
constexpr int kSearchPartialFormat = 4;

struct SearchPartial : PartialHeader {
    ModelInput confirm;
    std::vector<int> grid;
    std::size_t tier_plans = 0, tier_candidates = 0, rank_plans = 0;
    // A screened tier fit (search.screen): the candidates each head's tier_candidates options are
    // chosen from, and which every tier unit names per KV head; 0 where the fit screens nothing.
    std::size_t tier_screened = 0;
    bool streaming = false;
    int num_layers = 0, num_kv_heads = 0;
    std::vector<std::string> fitting_sequences, heldout_sequences;
    std::map<std::size_t, SearchUnitResult> done;

    SearchPassPlans pass_plans() const {
        return {grid.size(), tier_plans, tier_candidates, streaming ? 1u : 0u, rank_plans};
    }
    SearchUnit unit(std::size_t index) const { return search_unit(index, pass_plans(), num_layers); }
    std::size_t unit_count() const {
        std::size_t plans = 0;
        for (std::size_t n : pass_plans()) plans += n;
        return plans * static_cast<std::size_t>(num_layers);
    }
    // The sequences a unit's streams cover: the held-out ones for the tier fit's bytes, else the fitting ones.
    const std::vector<std::string>& sequences_of(const SearchUnit& u) const {
        return u.pass == SearchUnit::Pass::tier_bytes ? heldout_sequences : fitting_sequences;
    }
};

const char* pass_name(SearchUnit::Pass pass) {
    switch (pass) {
        case SearchUnit::Pass::grid: return "grid";
        case SearchUnit::Pass::tier_bytes: return "tier bytes";
        case SearchUnit::Pass::tier_errors: return "tier errors";
        case SearchUnit::Pass::streaming: return "streaming";
        case SearchUnit::Pass::rank_errors: return "rank errors";
    }
    return "";
}

// What a search's units are, for the merge's message on missing ones.
std::string search_unit_name(const SearchPartial& p) {
    std::vector<std::string> kinds;
    if (!p.grid.empty()) kinds.push_back("grid budget");
    if (p.tier_plans) kinds.push_back("tier plan");
    if (p.streaming) kinds.push_back("streaming fit");
    if (p.rank_plans) kinds.push_back("rank plan");
    std::string text;
    for (std::size_t i = 0; i < kinds.size(); ++i) text += (i ? " or " : "") + kinds[i];
    return text + " x layer";
}

Json confirm_json(const ModelInput& m) {
    return {{"model", m.model_path}, {"text", m.text_path}, {"split_on", m.split_on}, {"max_tokens", m.max_tokens},
            {"context", m.context}};
}

// What a search shard's measurements depend on besides the trace and the kvsim version: the config
// file's bytes, the grid, tier plans and split it expands to, and the model flags the merge confirms with.
std::string search_config_hash(const std::string& config_path, const SearchPartial& p) {
    return config_sha256_of(config_path, '\0' + Json{{"grid", p.grid},
                                                     {"tier_plans", p.tier_plans},
                                                     {"tier_candidates", p.tier_candidates},
                                                     {"tier_screened", p.tier_screened},
                                                     {"streaming", p.streaming},
                                                     {"rank_plans", p.rank_plans},
                                                     {"num_layers", p.num_layers},
                                                     {"num_kv_heads", p.num_kv_heads},
                                                     {"fitting_sequences", p.fitting_sequences},
                                                     {"heldout_sequences", p.heldout_sequences},
                                                     {"confirm", confirm_json(p.confirm)}}
                                                         .dump());
}

std::string search_partial_text(const SearchPartial& p) {
    Json results = Json::array();
    for (const auto& [unit, measured] : p.done) {
        const SearchUnit u = p.unit(unit);
        Json result = {{"unit", unit}, {"pass", pass_name(u.pass)}};
        if (u.pass == SearchUnit::Pass::grid)
            result["budget"] = p.grid.at(u.plan);
        else if (u.pass != SearchUnit::Pass::streaming)
            result["plan"] = u.plan;
        result["layer"] = u.layer;
        if (u.pass == SearchUnit::Pass::streaming) {
            Json heads = Json::array();
            for (const StreamingHeadFit& h : measured.heads)
                heads.push_back(Json::array({h.lambda, h.error, h.error_sum, h.calibrated_lambda, h.error_099,
                                             h.error_calibrated, h.error_stateless, h.error_stateless_sum}));
            result["heads"] = heads;
        } else {
            Json list = Json::array();
            for (const StreamMetrics& m : measured.streams) list.push_back(stream_json(m));
            result["streams"] = list;
            if (!measured.tier_options.empty()) result["options"] = measured.tier_options;
        }
        results.push_back(result);
    }
    Json j = {{"kvsim_search_partial", kSearchPartialFormat}};
    write_identity(j, p);
    j["config"] = p.config_path;
    j["confirm"] = confirm_json(p.confirm);
    write_range(j, p);
    j["grid"] = p.grid;
    j["tier_plans"] = p.tier_plans;
    j["tier_candidates"] = p.tier_candidates;
    j["tier_screened"] = p.tier_screened;
    j["streaming"] = p.streaming;
    j["rank_plans"] = p.rank_plans;
    j["num_layers"] = p.num_layers;
    j["num_kv_heads"] = p.num_kv_heads;
    j["fitting_sequences"] = p.fitting_sequences;
    j["heldout_sequences"] = p.heldout_sequences;
    j["results"] = results;
    return to_json_text(j) + "\n";
}

// A screened tier unit's options: per KV head, the candidate indices of its options, as many as
// the fit keeps a head (tier_candidates), ascending, each one of the tier_screened candidates.
std::vector<std::vector<std::size_t>> read_tier_options(const PartialReader& r, const Json& options,
                                                        const std::string& field, const SearchPartial& p) {
    const auto kv_heads = static_cast<std::size_t>(p.num_kv_heads);
    const Json& heads = r.exactly(options, field, kv_heads, "one list per KV head: " + std::to_string(kv_heads));
    std::vector<std::vector<std::size_t>> out;
    for (std::size_t k = 0; k < kv_heads; ++k) {
        const std::string at = field + "[" + std::to_string(k) + "]";
        const Json& list = r.exactly(heads[k], at, p.tier_candidates,
                                     "the head's " + std::to_string(p.tier_candidates) + " options");
        std::vector<std::size_t> kept;
        for (std::size_t n = 0; n < list.size(); ++n) {
            const std::string item = at + "[" + std::to_string(n) + "]";
            kept.push_back(static_cast<std::size_t>(
                r.integer(list[n], item, 0, static_cast<int64_t>(p.tier_screened) - 1)));
            if (n > 0 && kept[n] <= kept[n - 1]) r.fail(item, "options must ascend");
        }
        out.push_back(std::move(kept));
    }
    return out;
}

SearchPartial read_search_partial(const std::string& path) {
    const Json j = load_ordered_json_file(path);
    const PartialReader r(path, "kvsim search partial file");
    SearchPartial p;
    p.path = path;
    if (r.integer(r.at(j, "", "kvsim_search_partial"), "kvsim_search_partial", 0, 1 << 30) != kSearchPartialFormat)
        r.fail("kvsim_search_partial", "format " + PartialReader::shown(j["kvsim_search_partial"]) +
                                           " is not the one this kvsim reads (" + std::to_string(kSearchPartialFormat) +
                                           ")");
    read_identity(r, j, p);
    p.config_path = r.string(r.at(j, "", "config"), "config");
    if (p.config_path.empty() || p.config_path.find('\0') != std::string::npos) r.fail("config", "not a file name");
    const Json& c = r.at(j, "", "confirm");
    p.confirm.model_path = r.string(r.at(c, "confirm", "model"), "confirm.model");
    p.confirm.text_path = r.string(r.at(c, "confirm", "text"), "confirm.text");
    p.confirm.split_on = r.string(r.at(c, "confirm", "split_on"), "confirm.split_on");
    p.confirm.max_tokens = static_cast<int>(r.integer(r.at(c, "confirm", "max_tokens"), "confirm.max_tokens", 0, 1 << 30));
    p.confirm.context = static_cast<int>(r.integer(r.at(c, "confirm", "context"), "confirm.context", 0, 1 << 30));
    const Json& grid = r.list(r.at(j, "", "grid"), "grid", 1 << 16);
    if (grid.size() == 1) r.fail("grid", "expected at least two budgets, or none (a search without budget fits)");
    for (std::size_t i = 0; i < grid.size(); ++i) {
        const std::string field = "grid[" + std::to_string(i) + "]";
        p.grid.push_back(static_cast<int>(r.integer(grid[i], field, 1, kMaxBudgetTokens)));
        if (i > 0 && p.grid[i] <= p.grid[i - 1]) r.fail(field, "budgets must ascend");
    }
    p.tier_plans = static_cast<std::size_t>(r.integer(r.at(j, "", "tier_plans"), "tier_plans", 0, 1 << 16));
    p.tier_candidates = static_cast<std::size_t>(r.integer(r.at(j, "", "tier_candidates"), "tier_candidates", 0,
                                                           static_cast<int64_t>(p.tier_plans)));
    if ((p.tier_plans == 0) != (p.tier_candidates == 0))
        r.fail("tier_candidates", "a tier fit has candidates among its plans, and no tier fit has neither");
    p.tier_screened = static_cast<std::size_t>(r.integer(r.at(j, "", "tier_screened"), "tier_screened", 0, 1 << 16));
    if (p.tier_screened != 0 && p.tier_screened <= p.tier_candidates)
        r.fail("tier_screened", "a screened tier fit chooses its " + std::to_string(p.tier_candidates) +
                                    " options per head from more candidates than that, or is 0");
    const Json& streaming = r.at(j, "", "streaming");
    if (!streaming.is_boolean()) r.fail("streaming", "expected true or false, got " + PartialReader::shown(streaming));
    p.streaming = streaming.get<bool>();
    p.rank_plans = static_cast<std::size_t>(r.integer(r.at(j, "", "rank_plans"), "rank_plans", 0, 1 << 20));
    if (p.grid.empty() && p.tier_plans == 0 && !p.streaming && p.rank_plans == 0)
        r.fail("grid", "empty, with no tier plans, streaming fit or rank plans: nothing was measured");
    p.num_layers = static_cast<int>(r.integer(r.at(j, "", "num_layers"), "num_layers", 1, kMaxShape));
    p.num_kv_heads = static_cast<int>(r.integer(r.at(j, "", "num_kv_heads"), "num_kv_heads", 1, kMaxShape));
    const Json& fitting = r.list(r.at(j, "", "fitting_sequences"), "fitting_sequences", 1 << 20);
    if (fitting.empty()) r.fail("fitting_sequences", "empty");
    p.fitting_sequences = r.strings(fitting, "fitting_sequences", fitting.size());
    const Json& heldout = r.list(r.at(j, "", "heldout_sequences"), "heldout_sequences", 1 << 20);
    if (heldout.empty()) r.fail("heldout_sequences", "empty");
    p.heldout_sequences = r.strings(heldout, "heldout_sequences", heldout.size());
    read_range(r, j, p, p.unit_count());
    const std::size_t kv_heads = static_cast<std::size_t>(p.num_kv_heads);
    const std::size_t streams = std::max(p.fitting_sequences.size(), p.heldout_sequences.size()) * kv_heads;
    check_memory(checked_mul(checked_mul(p.units, streams, path), sizeof(StreamMetrics), path),
                 path + ": the measured sums (" + std::to_string(p.units) + " units x up to " + std::to_string(streams) +
                     " streams)");
    const Json& results = r.list(r.at(j, "", "results"), "results", p.end - p.first);
    // Steps per sequence, checked across units: the fitting sequences, then the held-out ones.
    StepsPerSequence steps;
    for (std::size_t i = 0; i < results.size(); ++i) {
        const std::string field = "results[" + std::to_string(i) + "]";
        const std::size_t unit = read_unit(r, results[i], field, p, p.done);
        const SearchUnit u = p.unit(unit);
        if (r.string(r.at(results[i], field, "pass"), field + ".pass") != pass_name(u.pass))
            r.fail(field + ".pass", "is not unit " + std::to_string(unit) + "'s pass, " + pass_name(u.pass));
        if (u.pass == SearchUnit::Pass::grid) {
            if (r.integer(r.at(results[i], field, "budget"), field + ".budget", 1, kMaxBudgetTokens) != p.grid[u.plan])
                r.fail(field + ".budget", "is not grid budget " + std::to_string(p.grid[u.plan]) + " of unit " +
                                              std::to_string(unit));
        } else if (u.pass != SearchUnit::Pass::streaming &&
                   static_cast<std::size_t>(r.integer(r.at(results[i], field, "plan"), field + ".plan", 0, 1 << 20)) !=
                       u.plan) {
            r.fail(field + ".plan", "is not plan " + std::to_string(u.plan) + " of unit " + std::to_string(unit));
        }
        if (r.integer(r.at(results[i], field, "layer"), field + ".layer", 0, p.num_layers - 1) != u.layer)
            r.fail(field + ".layer", "is not layer " + std::to_string(u.layer) + " of unit " + std::to_string(unit));
        SearchUnitResult measured;
        if (u.pass == SearchUnit::Pass::streaming) {
            // Per KV head: lambda, error, error sum, calibrated lambda, errors at 0.99, calibrated
            // and stateless, the stateless error's sum.
            const Json& heads = r.exactly(r.at(results[i], field, "heads"), field + ".heads", kv_heads,
                                          "one head per KV head: " + std::to_string(kv_heads));
            for (std::size_t k = 0; k < kv_heads; ++k) {
                const std::string at = field + ".heads[" + std::to_string(k) + "]";
                const Json& h = r.exactly(heads[k], at, 8, "the 8 numbers of a head's streaming fit");
                // A lambda is a number in [0, 1]; an error may be NaN (null), as a stream's may.
                auto lambda = [&](int n) { return r.number(h[n], at + "[" + std::to_string(n) + "]", 0, 1); };
                auto error = [&](int n) { return r.number(h[n], at + "[" + std::to_string(n) + "]", 0, 1e300, true); };
                measured.heads.push_back(
                    {lambda(0), error(1), error(2), lambda(3), error(4), error(5), error(6), error(7)});
            }
        } else {
            const std::size_t sequences = p.sequences_of(u).size();
            const std::size_t first_sequence = u.pass == SearchUnit::Pass::tier_bytes ? p.fitting_sequences.size() : 0;
            const std::size_t unit_streams_count = sequences * kv_heads;
            const Json& list = r.exactly(r.at(results[i], field, "streams"), field + ".streams", unit_streams_count,
                                         std::string("one stream per (") + (first_sequence ? "held-out" : "fitting") +
                                             " sequence, KV head): " + std::to_string(unit_streams_count));
            for (std::size_t k = 0; k < unit_streams_count; ++k) {
                const std::string at = field + ".streams[" + std::to_string(k) + "]";
                // A search's partial holds no sequence lengths: the steps are checked against each other.
                measured.streams.push_back(read_stream(r, list[k], at, 0, 1));
                steps.check(r, at + "[1] (steps)", first_sequence + k / kv_heads, measured.streams.back().steps);
            }
            const bool tier_unit = u.pass == SearchUnit::Pass::tier_bytes || u.pass == SearchUnit::Pass::tier_errors;
            if (tier_unit && p.tier_screened > 0)
                measured.tier_options = read_tier_options(r, r.at(results[i], field, "options"), field + ".options", p);
            else if (results[i].contains("options"))
                r.fail(field + ".options", tier_unit ? "a tier fit that screens nothing (tier_screened 0) has none"
                                                     : "only a tier unit has options");
        }
        p.done[unit] = std::move(measured);
    }
    if (p.complete && p.done.size() != p.end - p.first)
        r.fail("complete", "true, but " + std::to_string(p.end - p.first - p.done.size()) + " of the shard's " +
                               std::to_string(p.end - p.first) + " units are missing");
    return p;
}

// Every partial's units replay the same steps of each sequence (read_search_partial checked that
// within a file): partials whose steps differ are not of one run, however their headers agree.
// Sequences are numbered as there: the fitting ones, then the held-out ones.
void refuse_search_steps_differences(const std::vector<SearchPartial>& partials) {
    std::map<std::size_t, std::pair<int64_t, const SearchPartial*>> seen;
    for (const SearchPartial& p : partials) {
        const auto kv_heads = static_cast<std::size_t>(p.num_kv_heads);
        for (const auto& [unit, measured] : p.done) {
            const SearchUnit u = p.unit(unit);
            const std::vector<StreamMetrics>& streams = measured.streams;  // none in a streaming unit
            const std::size_t first_sequence = u.pass == SearchUnit::Pass::tier_bytes ? p.fitting_sequences.size() : 0;
            for (std::size_t k = 0; k < streams.size(); k += kv_heads) {
                const std::size_t sequence = first_sequence + k / kv_heads;
                const auto [it, inserted] = seen.emplace(sequence, std::make_pair(streams[k].steps, &p));
                if (!inserted && it->second.first != streams[k].steps)
                    throw InputError(p.path + ": the streams of sequence " + std::to_string(sequence) + " replay " +
                                     std::to_string(streams[k].steps) + " steps, and " + it->second.second->path +
                                     "'s replay " + std::to_string(it->second.first) +
                                     ": partials of different runs cannot merge");
            }
        }
    }
}

}  // namespace

SearchShardOutcome run_search_shard(const SearchSpec& spec, const SearchRun& run, const SearchShardRun& shard_run) {
    SearchShardWork work(spec, run);
    SearchPartial partial;
    partial.kvsim_version = KVSIM_VERSION;
    partial.config_path = shard_run.config_path;
    partial.confirm = shard_run.confirm;
    partial.grid = work.grid();
    partial.tier_plans = work.pass_plans()[1];
    partial.tier_candidates = work.pass_plans()[2];
    if (partial.tier_plans > 0) {
        const std::size_t candidates = tier_fit_plans(spec, work.num_layers(), work.num_kv_heads()).candidates.size();
        partial.tier_screened = partial.tier_candidates < candidates ? candidates : 0;
    }
    partial.streaming = work.pass_plans()[3] > 0;
    partial.rank_plans = work.pass_plans()[4];
    partial.num_layers = work.num_layers();
    partial.num_kv_heads = work.num_kv_heads();
    partial.fitting_sequences = work.fitting_sequences();
    partial.heldout_sequences = work.heldout_sequences();
    partial.config_sha256 = search_config_hash(shard_run.config_path, partial);
    HashBeside trace_sha256([path = run.trace_path] { return sha256_file(path); }, partial.trace_sha256);
    partial.shard = shard_run.shard;
    partial.units = work.unit_count();
    std::tie(partial.first, partial.end) = shard_range(partial.units, partial.shard);
    partial.path = shard_run.out_dir + "/" + partial_file_name(partial.shard);

    SearchShardOutcome outcome;
    outcome.units = partial.end - partial.first;
    outcome.partial_path = partial.path;
    const OutputFolder folder(shard_run.out_dir, OutputFolder::Access::shared);
    if (shard_run.resume && std::filesystem::exists(partial.path)) {
        SearchPartial previous = read_search_partial(partial.path);
        trace_sha256.settle();
        refuse_other_run(previous, partial);
        partial.done = std::move(previous.done);
        outcome.units_resumed = partial.done.size();
    }
    const std::vector<std::size_t> todo = unfinished_units(partial, partial.done);
    outcome.units_run = todo.size();

    // Checkpoints after every pass's layer, as a sweep's shard writes them after every layer.
    Checkpoint checkpoint(partial.path, !partial.done.empty());
    try {
        work.run_units(todo, [&](const std::vector<std::size_t>& units, std::vector<SearchUnitResult>& results) {
            for (std::size_t i = 0; i < units.size(); ++i) partial.done[units[i]] = std::move(results[i]);
            trace_sha256.settle();
            checkpoint.write(search_partial_text(partial));
        });
        trace_sha256.settle();
    } catch (...) {
        checkpoint.abandon();
        throw;
    }
    partial.complete = true;
    checkpoint.write(search_partial_text(partial));
    return outcome;
}

void check_partial_file(const std::string& path) {
    if (holds_search_partials({path}))
        (void)read_search_partial(path);
    else
        (void)read_partial(path);
}

bool holds_search_partials(const std::vector<std::string>& files) {
    return !files.empty() && load_json_file(files.front()).contains("kvsim_search_partial");
}

SearchMerge merge_search_partials(const std::vector<std::string>& files) {
    std::vector<SearchPartial> partials;
    for (const std::string& f : files) partials.push_back(read_search_partial(f));
    const SearchPartial& first = partials.front();
    std::map<int, const SearchPartial*> by_shard;
    for (const SearchPartial& p : partials) {
        refuse_different_runs(p, first);
        const auto [it, inserted] = by_shard.emplace(p.shard.index, &p);
        if (!inserted)
            throw InputError(p.path + ": shard " + p.shard.text() + " also in " + it->second->path +
                             ": give each shard once");
    }
    std::map<int, std::size_t> done;
    for (const auto& [index, p] : by_shard) done[index] = p->done.size();
    refuse_missing_units(first.units, first.shard.count, done, search_unit_name(first).c_str());

    // The rest of the search runs here from the config and trace the shards measured: the same
    // bytes, or the merge would fit curves of one config to another's.
    if (first.kvsim_version != KVSIM_VERSION)
        throw InputError(first.path + ": written by kvsim " + first.kvsim_version + ", and this is kvsim " KVSIM_VERSION
                         "; merge with the kvsim that ran the shards");
    SearchMerge out;
    out.config = load_config(first.config_path);
    // Every partial's grid, shape, fitting sequences and model flags are those the config's hash
    // covers, not only the first's.
    for (const SearchPartial& p : partials) {
        const std::string config_sha = search_config_hash(first.config_path, p);
        if (config_sha != p.config_sha256)
            throw InputError(first.config_path + ": changed since the shards ran, or " + p.path +
                             " was edited (config_sha256 " + config_sha + " of the config with its grid, shape and "
                             "fitting sequences, and it has " + p.config_sha256 + "); rerun the shards");
    }
    refuse_search_steps_differences(partials);
    const std::string trace_sha = sha256_file(out.config.trace.path);
    if (trace_sha != first.trace_sha256)
        throw InputError(out.config.trace.path + ": changed since the shards ran (trace_sha256 " + trace_sha + ", " +
                         first.path + " has " + first.trace_sha256 + "); rerun the shards");
    // A screened tier fit's options per layer, from whichever shard screened it: every tier unit
    // of a layer must name the same, or the shards' screens differed.
    std::map<int, std::pair<const std::vector<std::vector<std::size_t>>*, std::string>> options_of_layer;
    for (const SearchPartial& p : partials)
        for (const auto& [u, measured] : p.done) {
            if (measured.tier_options.empty()) continue;
            const int layer = p.unit(u).layer;
            const std::string where = p.path + ": unit " + std::to_string(u);
            const auto [it, inserted] = options_of_layer.emplace(layer, std::make_pair(&measured.tier_options, where));
            if (!inserted && *it->second.first != measured.tier_options)
                throw InputError(where + "'s tier options (layer " + std::to_string(layer) + ") differ from " +
                                 it->second.second + "'s: the shards screened differently; rerun the shards");
        }
    out.confirm = first.confirm;
    out.units.resize(first.units);
    for (const SearchPartial& p : partials)
        for (const auto& [u, streams] : p.done) out.units[u] = streams;
    out.shards = first.shard.count;
    out.unit_count = first.units;
    return out;
}

namespace {

// A word for a POSIX shell, single-quoted: inside single quotes the shell expands nothing, and a
// single quote is closed, escaped and reopened.
std::string shell_quote(const std::string& word) {
    std::string out = "'";
    for (char c : word) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return out + "'";
}

// A file name pattern of sbatch's: '%' starts a field (%A, %a, %j), and "%%" is a '%'.
std::string slurm_file_pattern(const std::string& path) {
    std::string out;
    for (char c : path) out += c == '%' ? std::string("%%") : std::string(1, c);
    return out;
}

// An argument of an #SBATCH line, as sbatch reads one: a backslash takes the next character as
// it is, so whitespace, quotes, '#' (the rest of the line a comment) and backslashes are escaped.
std::string sbatch_directive_word(const std::string& word) {
    std::string out;
    for (char c : word) {
        if (c == ' ' || c == '\t' || c == '"' || c == '\'' || c == '#' || c == '\\') out += '\\';
        out += c;
    }
    return out;
}

// A job name of letters, digits, '.', '_' and '-' only: it goes into #SBATCH lines and squeue's
// listings, where nothing else needs to be read literally.
std::string slurm_job_name(const std::string& name) {
    std::string out;
    for (char c : name) out += std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' ? c : '_';
    return out;
}

// A line break (or another control character) cannot be quoted in a comment or an #SBATCH line:
// it would end the line and start a command. Such a value is refused, shown with its controls
// escaped so that the error stays on one line.
void refuse_control_characters(const std::string& value, const std::string& what) {
    if (std::none_of(value.begin(), value.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; }))
        return;
    std::string shown;
    for (char c : value) {
        if (static_cast<unsigned char>(c) >= 0x20 && c != 0x7f) {
            shown += c;
            continue;
        }
        char escaped[8];
        std::snprintf(escaped, sizeof escaped, c == '\n' ? "\\n" : "\\x%02x", static_cast<unsigned char>(c));
        shown += escaped;
    }
    throw InputError("--emit-slurm: " + what + " '" + shown +
                     "' holds a line break or another control character, which a batch script cannot carry; "
                     "rename it");
}

}  // namespace

void write_slurm_script(const SlurmScript& s) {
    const std::string out_dir = std::filesystem::absolute(s.out_dir).lexically_normal().string();
    refuse_control_characters(s.path, "the script's path");
    refuse_control_characters(out_dir, "the output folder");
    refuse_control_characters(s.kvsim, "the kvsim binary's path");
    refuse_control_characters(s.workdir, "the working folder");
    for (const std::string& a : s.command_args) refuse_control_characters(a, "the argument");
    const std::string job_name = slurm_job_name(s.job_name);
    const std::string log_folder = slurm_file_pattern(out_dir);
    std::string command = shell_quote(s.kvsim);
    for (const std::string& a : s.command_args) command += " " + shell_quote(a);
    command += " --out " + shell_quote(out_dir);
    const std::string array = "0-" + std::to_string(s.shards - 1) +
                              (s.max_running > 0 ? "%" + std::to_string(s.max_running) : "");
    std::string text;
    text += "#!/bin/bash\n";
    text += "# Written by kvsim " KVSIM_VERSION ": a " + s.command_args.front() + " as a Slurm job array of " +
            std::to_string(s.shards) + " shards, then a merge job.\n";
    text += "# Submit it with `bash " + s.path + "` on a node that runs sbatch: it submits itself as the\n";
    text += "# array, then the merge, which starts once every shard has succeeded (afterok) and writes\n";
    text += "# " + s.outputs + " into " + out_dir + ".\n";
    text += "# Each array task runs shard $SLURM_ARRAY_TASK_ID and resumes its own checkpoint, so a shard that\n";
    text += "# failed or lost its node is rerun alone with `sbatch --array=I " + s.path + "`, redoing only what\n";
    text += "# it had not finished; `kvsim merge` names the shards a merge still misses.\n";
    text += "#SBATCH --job-name=" + job_name + "\n";
    text += "#SBATCH --array=" + array + "\n";
    text += "#SBATCH --output=" + sbatch_directive_word(log_folder + "/slurm-%A_%a.out") + "\n";
    text += "set -euo pipefail\n";
    text += "cd " + shell_quote(s.workdir) + "\n";
    text += "if [ \"${1:-}\" = merge ]; then\n";
    text += "    exec " + shell_quote(s.kvsim) + " merge " + shell_quote(out_dir) + "\n";
    text += "fi\n";
    text += "if [ -z \"${SLURM_ARRAY_TASK_ID:-}\" ]; then\n";
    text += "    script=$(readlink -f \"${BASH_SOURCE[0]}\")\n";
    text += "    mkdir -p " + shell_quote(out_dir) + "\n";
    text += "    array_job=$(sbatch --parsable \"$script\")\n";
    text += "    array_job=${array_job%%;*}\n";
    text += "    merge_job=$(sbatch --parsable --array=0 --job-name=" + job_name +
            "-merge --dependency=afterok:\"$array_job\" --output=" + shell_quote(log_folder + "/slurm-merge-%A.out") +
            " \"$script\" merge)\n";
    text += "    echo \"submitted array job $array_job (" + std::to_string(s.shards) +
            " shards) and merge job ${merge_job%%;*}\"\n";
    text += "    exit 0\n";
    text += "fi\n";
    text += "exec " + command + " --shard \"$SLURM_ARRAY_TASK_ID/" + std::to_string(s.shards) + "\" --resume --quiet\n";
    write_file_atomically(s.path, text);
    if (::chmod(s.path.c_str(), 0755) != 0) throw InputError(s.path + ": cannot make executable");
}

}  // namespace kvsim
