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
#include "src/report.h"

namespace kvsim {
namespace {

using Json = nlohmann::ordered_json;
constexpr int kPartialFormat = 1;

// A number as JSON holds it: doubles round-trip exactly; non-finite ones are written as null and
// read back as NaN, which the results files write as null again.
double read_double(const Json& j) { return j.is_null() ? NAN : j.get<double>(); }

Json stream_json(const StreamMetrics& m) {
    return Json::array({m.retained_mass, m.steps, m.heavy_hitter_hits, m.heavy_hitter_possible, m.eviction_calls,
                        m.output_rel_error, m.output_cosine, m.output_steps, m.cache_bytes, m.fp16_bytes,
                        m.context_tokens});
}

StreamMetrics read_stream(const Json& j) {
    if (!j.is_array() || j.size() != 11) throw std::invalid_argument("a stream is 11 numbers");
    StreamMetrics m;
    m.retained_mass = read_double(j[0]);
    m.steps = j[1].get<int64_t>();
    m.heavy_hitter_hits = j[2].get<int64_t>();
    m.heavy_hitter_possible = j[3].get<int64_t>();
    m.eviction_calls = j[4].get<int64_t>();
    m.output_rel_error = read_double(j[5]);
    m.output_cosine = read_double(j[6]);
    m.output_steps = j[7].get<int64_t>();
    m.cache_bytes = read_double(j[8]);
    m.fp16_bytes = read_double(j[9]);
    m.context_tokens = j[10].get<int64_t>();
    return m;
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

ResultFrame read_frame(const Json& j) {
    ResultFrame f;
    f.trace = j.at("trace").get<std::string>();
    f.metrics = j.at("metrics").get<std::vector<std::string>>();
    f.note = j.at("note").get<std::string>();
    f.per_layer = j.at("per_layer").get<bool>();
    f.per_sequence = j.at("per_sequence").get<bool>();
    f.num_layers = j.at("num_layers").get<int>();
    f.num_kv_heads = j.at("num_kv_heads").get<int>();
    f.group_size = j.at("group_size").get<int>();
    f.sequence_lengths = j.at("sequence_lengths").get<std::vector<int64_t>>();
    f.sequence_names = j.at("sequence_names").get<std::vector<std::string>>();
    f.sequence_index = j.at("sequence_index").get<std::vector<int>>();
    for (const Json& c : j.at("cells")) {
        CellInfo cell;
        cell.policy = c.at("policy").get<std::string>();
        cell.label = c.at("label").get<std::string>();
        for (const auto& [name, value] : c.at("params").items()) cell.params[name] = value.get<double>();
        cell.keeps_everything = c.at("keeps_everything").get<bool>();
        cell.compression = c.at("compression").get<double>();
        cell.budget = c.at("budget").get<int>();
        cell.budget_label = c.at("budget_label").get<std::string>();
        cell.layer_budgets = c.at("layer_budgets").get<std::vector<int>>();
        f.cells.push_back(std::move(cell));
    }
    const std::size_t sequences = f.sequence_lengths.size();
    if (f.num_layers < 1 || f.num_kv_heads < 1 || f.group_size < 1 || f.sequence_names.size() != sequences ||
        f.sequence_index.size() != sequences || f.cells.empty())
        throw std::invalid_argument("frame: inconsistent shape");
    return f;
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

// `key` names the field being read, for the caller's error.
void read_identity(const Json& j, PartialHeader& p, const char*& key) {
    key = "kvsim_version";
    p.kvsim_version = j.at(key).get<std::string>();
    key = "config_sha256";
    p.config_sha256 = j.at(key).get<std::string>();
    key = "trace_sha256";
    p.trace_sha256 = j.at(key).get<std::string>();
}

// The shard and its range, which must be the shard's share of `units`, the count the rest of the
// file implies.
void read_range(const Json& j, PartialHeader& p, std::size_t units, const char*& key) {
    key = "shards";
    p.shard.count = j.at(key).get<int>();
    key = "shard";
    p.shard.index = j.at(key).get<int>();
    if (p.shard.count < 1 || p.shard.index < 0 || p.shard.index >= p.shard.count)
        throw std::invalid_argument("shard out of range");
    key = "units";
    p.units = j.at(key).get<std::size_t>();
    key = "first_unit";
    p.first = j.at(key).get<std::size_t>();
    key = "end_unit";
    p.end = j.at(key).get<std::size_t>();
    key = "complete";
    p.complete = j.at(key).get<bool>();
    if (p.units != units || shard_range(p.units, p.shard) != std::pair{p.first, p.end})
        throw std::invalid_argument("the unit range does not match the shard");
}

// A result's unit: inside the shard's range and not seen before in the file.
void check_unit(const PartialHeader& p, std::size_t unit, bool seen) {
    if (unit < p.first || unit >= p.end || seen)
        throw std::invalid_argument("unit " + std::to_string(unit) + " outside the shard or repeated");
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
    j["results"] = results;
    return to_json_text(j) + "\n";
}

Partial read_partial(const std::string& path) {
    const Json j = load_json_file(path);
    Partial p;
    p.path = path;
    const char* key = "";
    try {
        key = "kvsim_partial_results";
        if (j.at(key).get<int>() != kPartialFormat) throw std::invalid_argument("unknown format version");
        read_identity(j, p, key);
        key = "title";
        p.title = j.at(key).get<std::string>();
        key = "format";
        p.format = j.at(key).get<std::string>();
        key = "layout";
        p.layout = j.at(key).get<std::string>();
        key = "frame";
        p.frame_text = j.at(key);
        p.frame = read_frame(p.frame_text);
        read_range(j, p, p.frame.cells.size() * static_cast<std::size_t>(p.frame.num_layers), key);
        key = "results";
        const std::size_t streams = p.frame.sequence_lengths.size() * static_cast<std::size_t>(p.frame.num_kv_heads);
        for (const Json& r : j.at(key)) {
            const auto unit = r.at("unit").get<std::size_t>();
            check_unit(p, unit, p.done.count(unit));
            UnitResult result;
            result.policy_bytes_per_slot = r.at("policy_bytes_per_slot").get<std::size_t>();
            for (const Json& s : r.at("streams")) result.streams.push_back(read_stream(s));
            if (result.streams.size() != streams) throw std::invalid_argument("wrong number of streams");
            p.done[unit] = std::move(result);
        }
        if (p.complete && p.done.size() != p.end - p.first)
            throw std::invalid_argument("marked complete with units missing");
    } catch (const InputError&) {
        throw;
    } catch (const std::exception& e) {
        throw InputError(path + ": not a valid kvsim partial results file (key '" + std::string(key) + "': " +
                         e.what() + ")");
    }
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

// Search shards: a share of the grid replay's units (SearchGridReplay), checkpointed as a sweep's
// shard is, and their merge, which runs the rest of the search as one machine would.
namespace {

constexpr int kSearchPartialFormat = 1;

struct SearchPartial : PartialHeader {
    ModelInput confirm;
    std::vector<int> grid;
    int num_layers = 0, num_kv_heads = 0;
    std::vector<std::string> fitting_sequences;
    std::map<std::size_t, SearchUnitStreams> done;
};

Json confirm_json(const ModelInput& m) {
    return {{"model", m.model_path}, {"text", m.text_path}, {"split_on", m.split_on}, {"max_tokens", m.max_tokens},
            {"context", m.context}};
}

// What a search shard's measurements depend on besides the trace and the kvsim version: the config
// file's bytes, the grid and split it expands to, and the model flags the merge confirms with.
std::string search_config_hash(const std::string& config_path, const SearchPartial& p) {
    return config_sha256_of(config_path, '\0' + Json{{"grid", p.grid},
                                                     {"num_layers", p.num_layers},
                                                     {"num_kv_heads", p.num_kv_heads},
                                                     {"fitting_sequences", p.fitting_sequences},
                                                     {"confirm", confirm_json(p.confirm)}}
                                                         .dump());
}

std::string search_partial_text(const SearchPartial& p) {
    Json results = Json::array();
    const std::vector<WorkUnit> all = enumerate_work(p.grid.size(), p.num_layers);
    for (const auto& [unit, streams] : p.done) {
        Json list = Json::array();
        for (const StreamMetrics& m : streams) list.push_back(stream_json(m));
        results.push_back(Json{{"unit", unit}, {"budget", p.grid.at(all.at(unit).cell)}, {"layer", all.at(unit).layer},
                               {"streams", list}});
    }
    Json j = {{"kvsim_search_partial", kSearchPartialFormat}};
    write_identity(j, p);
    j["config"] = p.config_path;
    j["confirm"] = confirm_json(p.confirm);
    write_range(j, p);
    j["grid"] = p.grid;
    j["num_layers"] = p.num_layers;
    j["num_kv_heads"] = p.num_kv_heads;
    j["fitting_sequences"] = p.fitting_sequences;
    j["results"] = results;
    return to_json_text(j) + "\n";
}

SearchPartial read_search_partial(const std::string& path) {
    const Json j = load_json_file(path);
    SearchPartial p;
    p.path = path;
    const char* key = "";
    try {
        key = "kvsim_search_partial";
        if (j.at(key).get<int>() != kSearchPartialFormat) throw std::invalid_argument("unknown format version");
        read_identity(j, p, key);
        key = "config";
        p.config_path = j.at(key).get<std::string>();
        key = "confirm";
        const Json& c = j.at(key);
        p.confirm.model_path = c.at("model").get<std::string>();
        p.confirm.text_path = c.at("text").get<std::string>();
        p.confirm.split_on = c.at("split_on").get<std::string>();
        p.confirm.max_tokens = c.at("max_tokens").get<int>();
        p.confirm.context = c.at("context").get<int>();
        key = "grid";
        p.grid = j.at(key).get<std::vector<int>>();
        key = "num_layers";
        p.num_layers = j.at(key).get<int>();
        key = "num_kv_heads";
        p.num_kv_heads = j.at(key).get<int>();
        key = "fitting_sequences";
        p.fitting_sequences = j.at(key).get<std::vector<std::string>>();
        if (p.grid.empty() || p.num_layers < 1 || p.num_kv_heads < 1 || p.fitting_sequences.empty())
            throw std::invalid_argument("an empty grid, fitting set, or no layers or KV heads");
        read_range(j, p, p.grid.size() * static_cast<std::size_t>(p.num_layers), key);
        key = "results";
        for (const Json& r : j.at(key)) {
            const auto unit = r.at("unit").get<std::size_t>();
            check_unit(p, unit, p.done.count(unit));
            SearchUnitStreams streams;
            for (const Json& m : r.at("streams")) streams.push_back(read_stream(m));
            if (streams.size() != p.fitting_sequences.size() * static_cast<std::size_t>(p.num_kv_heads))
                throw std::invalid_argument("unit " + std::to_string(unit) + ": not one stream per (fitting sequence, KV head)");
            p.done[unit] = std::move(streams);
        }
        if (p.complete && p.done.size() != p.end - p.first)
            throw std::invalid_argument("marked complete with units missing");
    } catch (const InputError&) {
        throw;
    } catch (const std::exception& e) {
        throw InputError(path + ": not a valid kvsim search partial file (key '" + std::string(key) + "': " + e.what() +
                         ")");
    }
    return p;
}

}  // namespace

SearchShardOutcome run_search_shard(const SearchSpec& spec, const SearchRun& run, const SearchShardRun& shard_run) {
    SearchGridReplay grid(spec, run);
    SearchPartial partial;
    partial.kvsim_version = KVSIM_VERSION;
    partial.config_path = shard_run.config_path;
    partial.confirm = shard_run.confirm;
    partial.grid = grid.grid();
    partial.num_layers = grid.num_layers();
    partial.num_kv_heads = grid.num_kv_heads();
    partial.fitting_sequences = grid.fitting_sequences();
    partial.config_sha256 = search_config_hash(shard_run.config_path, partial);
    HashBeside trace_sha256([path = run.trace_path] { return sha256_file(path); }, partial.trace_sha256);
    partial.shard = shard_run.shard;
    partial.units = grid.unit_count();
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

    // Checkpoints after every layer, as a sweep's shard writes them.
    Checkpoint checkpoint(partial.path, !partial.done.empty());
    try {
        grid.run_units(todo, [&](const std::vector<std::size_t>& units, std::vector<SearchUnitStreams>& streams) {
            for (std::size_t i = 0; i < units.size(); ++i) partial.done[units[i]] = std::move(streams[i]);
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
    refuse_missing_units(first.units, first.shard.count, done, "grid budget x layer");

    // The rest of the search runs here from the config and trace the shards measured: the same
    // bytes, or the merge would fit curves of one config to another's.
    if (first.kvsim_version != KVSIM_VERSION)
        throw InputError(first.path + ": written by kvsim " + first.kvsim_version + ", and this is kvsim " KVSIM_VERSION
                         "; merge with the kvsim that ran the shards");
    SearchMerge out;
    out.config = load_config(first.config_path);
    const std::string config_sha = search_config_hash(first.config_path, first);
    if (config_sha != first.config_sha256)
        throw InputError(first.config_path + ": changed since the shards ran (config_sha256 " + config_sha + ", " +
                         first.path + " has " + first.config_sha256 + "); rerun the shards");
    const std::string trace_sha = sha256_file(out.config.trace.path);
    if (trace_sha != first.trace_sha256)
        throw InputError(out.config.trace.path + ": changed since the shards ran (trace_sha256 " + trace_sha + ", " +
                         first.path + " has " + first.trace_sha256 + "); rerun the shards");
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
