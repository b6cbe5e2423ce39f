#include "src/report_plots.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "base/input_file.h"
#include "base/json_file.h"
#include "base/output_folder.h"
#include "search/profile.h"
#include "sim/experiment_spec.h"

extern char** environ;

namespace kvsim {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;  // keeps the file's key order (tiers)

// ---- Reading the JSON files: every key that is plotted is type-checked, and an error names the
// file, the record and the key.

Json read_json(const std::string& path) { return load_ordered_json_file(path); }

// Four significant digits, for prose (report.md); the .dat files keep ten.
std::string short_number(double x) {
    char text[32];
    std::snprintf(text, sizeof text, "%.4g", x);
    return text;
}

// A number gnuplot can place on an axis: near double's limit (1e308) its autoscaling overflows and
// the figure fails, so values past 1e300 are refused as input (a perplexity of 1e200 still plots).
double plottable(double v, const std::string& where, const std::string& key) {
    if (std::fabs(v) > 1e300)
        throw InputError(where + ": '" + key + "' is " + short_number(v) + ", too large to plot (beyond 1e300)");
    return v;
}

// A number, or NaN where the key is absent or null (a metric that was not measured).
double optional_number(const Json& object, const std::string& key, const std::string& where) {
    const auto it = object.find(key);
    if (it == object.end() || it->is_null()) return NAN;
    if (!it->is_number()) throw InputError(where + ": '" + key + "' is not a number");
    return plottable(it->get<double>(), where, key);
}

// A metric to draw: a number, or the "inf" / "-inf" kvsim eval writes for a perplexity (or its
// rise) beyond a double, which no axis holds: not drawn.
double drawable_number(const Json& object, const std::string& key, const std::string& where) {
    const auto it = object.find(key);
    if (it != object.end() && it->is_string() && (*it == "inf" || *it == "-inf")) return NAN;
    return optional_number(object, key, where);
}

std::string optional_string(const Json& object, const std::string& key, const std::string& where) {
    const auto it = object.find(key);
    if (it == object.end() || it->is_null()) return "";
    if (!it->is_string()) throw InputError(where + ": '" + key + "' is not a string");
    return it->get<std::string>();
}

std::string required_string(const Json& object, const std::string& key, const std::string& where) {
    const auto it = object.find(key);
    if (it == object.end() || it->is_null()) throw InputError(where + ": '" + key + "' is missing");
    return optional_string(object, key, where);
}

int required_count(const Json& object, const std::string& key, const std::string& where) {
    const auto it = object.find(key);
    if (it == object.end()) throw InputError(where + ": '" + key + "' is missing");
    if (!it->is_number_integer() || it->get<int64_t>() < 1 || it->get<int64_t>() > 1'000'000)
        throw InputError(where + ": '" + key + "' is not a whole number from 1 to 1000000");
    return static_cast<int>(it->get<int64_t>());
}

// The "format" and "version" header of search.json.
void require_format(const Json& file, const std::string& format, const std::string& path) {
    if (!file.is_object()) throw InputError(path + ": not a JSON object");
    if (optional_string(file, "format", path) != format)
        throw InputError(path + ": 'format' is not \"" + format + "\"");
    if (optional_number(file, "version", path) != 1)
        throw InputError(path + ": 'version' is not 1 (the only version this kvsim reads)");
}

// ---- Figures. Each builder writes the data file's text and the gnuplot commands that draw it;
// figure_script() wraps those in the terminal settings for the SVG and the PNG.

struct Figure {
    std::string name;     // file stem: NAME.dat, NAME.gp, NAME.svg, NAME.png
    std::string title;    // above the plot, and the image's alt text in report.md
    std::string caption;  // one line under the figure in report.md
    std::string data;     // NAME.dat
    std::string plot;     // gnuplot commands; they read NAME.dat
};

// Text from input files goes into gnuplot strings, .gp comments and .dat comments: no line breaks
// (a comment or string would end there and the rest be read as commands).
std::string one_line(const std::string& text) {
    std::string out = text;
    for (char& c : out)
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
    return out;
}

// A gnuplot string that gnuplot takes literally: single-quoted, where it substitutes no backquoted
// command and expands no escape or macro (in double quotes, `cmd` runs cmd). A single quote is
// written twice.
std::string gnuplot_string(const std::string& text) {
    std::string out = "'";
    for (char c : one_line(text)) out += c == '\'' ? std::string("''") : std::string(1, c);
    return out + "'";
}

// A string column of a .dat file: gnuplot reads data files without substitution; double quotes
// keep a tag with spaces in one column, and no tag holds a double quote.
std::string data_string(const std::string& text) {
    std::string out = "\"";
    for (char c : one_line(text)) out += c == '"' ? '\'' : c;
    return out + "\"";
}

std::string number(double x) {
    char text[32];
    std::snprintf(text, sizeof text, "%.10g", x);
    return std::isnan(x) ? "NaN" : text;
}

enum class Better { higher, lower, unknown };

// Which way a metric improves; unknown metrics get no Pareto front.
Better direction(const std::string& metric) {
    for (const char* m : {"retained_mass", "heavy_hitter_recall", "output_cosine", "compression_ratio"})
        if (metric == m) return Better::higher;
    for (const char* m : {"output_rel_error", "ppl", "delta_ppl"})
        if (metric == m) return Better::lower;
    return Better::unknown;
}

std::string readable(const std::string& metric) {
    if (metric == "ppl") return "perplexity";
    if (metric == "delta_ppl") return "delta PPL (rise over the full cache)";
    std::string out = metric;
    std::replace(out.begin(), out.end(), '_', ' ');
    return out;
}

struct Point {
    double x = 0, y = 0;
    std::string tag;  // which budget (or search target) the point is, written beside it in the .dat
};

struct Series {
    std::string label;
    std::vector<Point> points;
};

// The points no other point beats: none with at most the same memory (x) and at least as good a
// value, one of the two strictly. Sweeping by memory, a point is on the front when it improves
// on every point with less memory; of equal-memory points only the best can be.
std::vector<Point> pareto_front(const std::vector<Series>& lines, Better better) {
    std::vector<Point> all;
    for (const Series& s : lines)
        for (const Point& p : s.points) all.push_back({p.x, p.y, p.tag.empty() ? s.label : s.label + " @ " + p.tag});
    const auto is_better = [better](double a, double b) { return better == Better::higher ? a > b : a < b; };
    std::stable_sort(all.begin(), all.end(), [&](const Point& a, const Point& b) {
        return a.x != b.x ? a.x < b.x : is_better(a.y, b.y);
    });
    std::vector<Point> front;
    for (const Point& p : all)
        if (front.empty() || is_better(p.y, front.back().y)) front.push_back(p);
    return front;
}

// One line per series (`line_kind`: policy, method) of `metric` against memory, the Pareto front
// circled when the metric's direction is known. Series without points are left out; no points at
// all, no figure.
std::vector<Figure> line_figure(const std::string& name, const std::string& source, std::vector<Series> lines,
                                const std::string& line_kind, const std::string& metric, const std::string& y_label,
                                const std::string& x_key, const std::string& x_label) {
    std::erase_if(lines, [](const Series& s) { return s.points.empty(); });
    if (lines.empty()) return {};
    Figure f;
    f.name = name;
    const Better better = direction(metric);
    f.data = "# kvsim report: " + metric + " against " + x_key + ", from " + source + "\n" +
             "# columns: " + x_key + ", " + metric + ", the budget or target of the point\n" +
             "# one block (gnuplot index) per line, in this order:\n";
    f.plot = "plot ";
    std::string blocks;
    int index = 0;
    for (Series& s : lines) {
        std::stable_sort(s.points.begin(), s.points.end(), [](const Point& a, const Point& b) { return a.x < b.x; });
        f.data += "#   index " + std::to_string(index) + ": " + one_line(s.label) + "\n";
        blocks += "\n# index " + std::to_string(index) + ": " + one_line(s.label) + "\n";
        for (const Point& p : s.points) blocks += number(p.x) + " " + number(p.y) + " " + data_string(p.tag) + "\n";
        blocks += "\n";  // two blank lines end a gnuplot index block
        f.plot += std::string(index ? ", \\\n     " : "") + "\"" + name + ".dat\" index " + std::to_string(index) +
                  " using 1:2 with linespoints title " + gnuplot_string(s.label);
        ++index;
    }
    if (better != Better::unknown) {
        const std::string front_title =
            std::string("Pareto front (") + (better == Better::higher ? "higher" : "lower") + " is better)";
        f.data += "#   index " + std::to_string(index) + ": " + front_title + "\n";
        blocks += "\n# index " + std::to_string(index) + ": " + front_title + "\n";
        for (const Point& p : pareto_front(lines, better))
            blocks += number(p.x) + " " + number(p.y) + " " + data_string(p.tag) + "\n";
        f.plot += ", \\\n     \"" + name + ".dat\" index " + std::to_string(index) +
                  " using 1:2 with points pointtype 6 pointsize 2.5 linewidth 2 linecolor rgb \"black\" title " +
                  gnuplot_string(front_title);
    }
    f.data += blocks;
    f.plot = "set xlabel " + gnuplot_string(x_label) + "\nset ylabel " + gnuplot_string(y_label) +
             "\nset key outside right top Left reverse\nset grid\n" + f.plot + "\n";
    f.caption = y_label + " against " + x_label + ", one line per " + line_kind;
    f.caption[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(f.caption[0])));
    if (better != Better::unknown)
        f.caption += std::string("; circles mark the Pareto front (") +
                     (better == Better::higher ? "higher" : "lower") + " is better, at least memory)";
    f.caption += ".";
    return {f};
}

// A (layer, KV head) grid as a heat map, the value printed in each cell while cells are few
// enough to read.
Figure heat_map(const std::string& name, const std::string& key, const std::vector<std::vector<double>>& rows,
                bool unit_range, const std::string& caption) {
    Figure f;
    f.name = name;
    f.caption = caption;
    f.data = "# kvsim report: " + key + " from profile.json, per (layer, KV head); NaN: no value\n"
             "# columns: KV head, layer, " + key + "; a blank line after each layer\n";
    const std::size_t heads = rows.empty() ? 0 : rows[0].size();
    for (std::size_t layer = 0; layer < rows.size(); ++layer) {
        for (std::size_t head = 0; head < heads; ++head)
            f.data += std::to_string(head) + " " + std::to_string(layer) + " " + number(rows[layer][head]) + "\n";
        f.data += "\n";
    }
    const std::string data = "\"" + name + ".dat\"";
    f.plot = "set xlabel \"KV head\"\nset ylabel \"layer\"\nset xtics 1\nset ytics 1\n"
             "set xrange [-0.5:" + std::to_string(heads) + " - 0.5]\n"
             "set yrange [" + std::to_string(rows.size()) + " - 0.5:-0.5]  # layer 0 at the top, as in the file\n"
             "set palette defined (0 \"#ffffcc\", 0.5 \"#fd8d3c\", 1 \"#bd0026\")\n" +
             (unit_range ? "set cbrange [0:1]\n" : "") +
             // One box per cell rather than `with image`, which cannot leave a missing cell blank.
             "set datafile missing \"NaN\"\n"
             "plot " + data + " using 1:2:(0.5):(0.5):3 with boxxyerror fillstyle solid noborder linecolor palette "
             "notitle";
    if (rows.size() * heads <= 256)
        f.plot += ", \\\n     " + data + " using 1:2:(sprintf(\"%.3g\", $3)) with labels textcolor rgb \"black\" "
                  "notitle";
    f.plot += "\n";
    return f;
}

// A mixed profile's heads as one map: each cell coloured by its method, its level written in it
// (an eviction head's budget, a tier head's FP16/INT8/INT4 shares in percent, a streaming head's
// lambda or "no state"). The labels are kvsim's own text, and reach gnuplot as data strings.
Figure method_map(const std::string& name, const MixedPlan& plan, const std::string& caption) {
    Figure f;
    f.name = name;
    f.caption = caption;
    f.data = "# kvsim report: mixed.method from profile.json, per (layer, KV head)\n"
             "# columns: KV head, layer, method (0 evict, 1 tiers, 2 streaming, 3 full), its level; a blank line "
             "after each layer\n";
    char level[64];
    for (int layer = 0; layer < plan.num_layers; ++layer) {
        for (int kv = 0; kv < plan.num_kv_heads; ++kv) {
            const std::size_t u = plan.index(layer, kv);
            switch (plan.method[u]) {
                case HeadMethod::evict: std::snprintf(level, sizeof level, "%d tokens", plan.budgets[u]); break;
                case HeadMethod::tiers:
                    std::snprintf(level, sizeof level, "%.0f/%.0f/%.0f%%", 100 * plan.fp16[u], 100 * plan.int8[u],
                                  100 * plan.int4[u]);
                    break;
                case HeadMethod::streaming:
                    if (plan.stateless[u])
                        std::snprintf(level, sizeof level, "no state");
                    else
                        std::snprintf(level, sizeof level, "lambda %.3g", plan.lambda[u]);
                    break;
                case HeadMethod::full: std::snprintf(level, sizeof level, "fp16"); break;
            }
            f.data += std::to_string(kv) + " " + std::to_string(layer) + " " +
                      std::to_string(static_cast<int>(plan.method[u])) + " " + data_string(level) + "\n";
        }
        f.data += "\n";
    }
    const std::string data = "\"" + name + ".dat\"";
    f.plot = "set xlabel \"KV head\"\nset ylabel \"layer\"\nset xtics 1\nset ytics 1\n"
             "set xrange [-0.5:" + std::to_string(plan.num_kv_heads) + " - 0.5]\n"
             "set yrange [" + std::to_string(plan.num_layers) + " - 0.5:-0.5]  # layer 0 at the top, as in the file\n"
             "set palette defined (0 \"#9ecae1\", 1 \"#fdae6b\", 2 \"#a1d99b\", 3 \"#d9d9d9\")\n"
             "set palette maxcolors 4\nset cbrange [-0.5:3.5]\n"
             "set cbtics (\"evict\" 0, \"tiers\" 1, \"streaming\" 2, \"full\" 3)\n"
             "plot " + data + " using 1:2:(0.5):(0.5):3 with boxxyerror fillstyle solid noborder linecolor palette "
             "notitle";
    if (static_cast<std::size_t>(plan.num_layers) * plan.num_kv_heads <= 256)
        f.plot += ", \\\n     " + data + " using 1:2:4 with labels textcolor rgb \"black\" notitle";
    f.plot += "\n";
    return f;
}

// The wrapper every .gp file shares: the figure drawn once as SVG, then again as PNG.
std::string figure_script(const Figure& f) {
    const std::string size = "size 960,540";
    return "# kvsim report: " + one_line(f.caption) + "\n" +
           "# To restyle, edit this file and run `gnuplot " + f.name + ".gp` in this folder: it reads " + f.name +
           ".dat\n# and redraws " + f.name + ".svg and " + f.name + ".png.\n" +
           "set terminal svg " + size + " dynamic noenhanced font \"sans,12\" background rgb \"white\"\n" +
           "set output \"" + f.name + ".svg\"\nset title " + gnuplot_string(f.title) + "\n" + f.plot +
           "set terminal pngcairo " + size + " noenhanced font \"sans,11\" background rgb \"white\"\n" +
           "set output \"" + f.name + ".png\"\nreplot\nunset output\n";
}

// ---- The three inputs.

struct Section {
    std::string source;        // results.json, search.json, profile.json
    std::string note;          // a line under the section heading
    std::vector<Figure> figures;
};

Section results_figures(const std::string& path) {
    const Json records = read_json(path);
    if (!records.is_array()) throw InputError(path + ": not a JSON list of records");
    const char* metrics[] = {"retained_mass", "heavy_hitter_recall", "output_rel_error", "output_cosine",
                             "compression_ratio", "ppl", "delta_ppl"};
    struct Row {
        std::string label, tag;
        double budget, bytes;
        std::vector<double> values;  // one per metric above
    };
    std::vector<Row> rows;
    for (std::size_t i = 0; i < records.size(); ++i) {
        const Json& r = records[i];
        const std::string where = path + ": record " + std::to_string(i);
        if (!r.is_object()) throw InputError(where + ": not a JSON object");
        const double layer = optional_number(r, "layer", where);
        Row row;
        const std::string policy = optional_string(r, "policy", where);
        row.label = optional_string(r, "label", where);
        if (row.label.empty()) row.label = policy;
        if (row.label.empty()) throw InputError(where + ": 'label' is missing");
        row.budget = optional_number(r, "budget", where);
        row.bytes = optional_number(r, "bytes_per_token", where);
        row.tag = optional_string(r, "budget_label", where);
        if (row.tag == kEveryBudget) row.tag.clear();  // a policy that keeps every token has no budget to name
        if (row.tag.empty()) row.tag = optional_string(r, "budget_profile", where);
        if (row.tag.empty() && row.budget > 0) row.tag = number(row.budget);  // null or 0: no budget
        for (const char* m : metrics) row.values.push_back(drawable_number(r, m, where));
        // Per-layer and per-sequence records would stack under their whole-trace record.
        if (layer >= 0 || r.contains("sequence")) continue;
        rows.push_back(std::move(row));
    }
    // Memory is bytes per token wherever it was measured; budgets (tokens) only count memory when
    // every configuration stores a token alike.
    const bool by_bytes = std::any_of(rows.begin(), rows.end(), [](const Row& r) { return !std::isnan(r.bytes); });
    const std::string x_key = by_bytes ? "bytes_per_token" : "budget";
    const std::string x_label =
        by_bytes ? "bytes per token (per layer and KV head)" : "budget (tokens per layer and KV head)";
    Section section{"results.json", std::to_string(rows.size()) + " whole-trace records", {}};
    for (std::size_t m = 0; m < std::size(metrics); ++m) {
        std::vector<Series> lines;
        for (const Row& row : rows) {
            auto line = std::find_if(lines.begin(), lines.end(), [&](const Series& s) { return s.label == row.label; });
            if (line == lines.end()) line = lines.insert(lines.end(), Series{row.label, {}});
            const double x = by_bytes ? row.bytes : row.budget;
            if (!std::isnan(x) && !std::isnan(row.values[m])) line->points.push_back({x, row.values[m], row.tag});
        }
        for (Figure& f : line_figure(std::string("results-") + metrics[m], "results.json", lines, "policy",
                                     metrics[m], readable(metrics[m]), x_key, x_label)) {
            f.title = readable(metrics[m]) + " against " + (by_bytes ? "memory" : "budget");
            section.figures.push_back(std::move(f));
        }
    }
    return section;
}

Section search_figures(const std::string& path) {
    const Json file = read_json(path);
    require_format(file, "kvsim-search", path);
    const std::string objective = required_string(file, "objective", path);
    const auto records = file.find("records");
    if (records == file.end() || !records->is_array()) throw InputError(path + ": 'records' is not a list");
    std::vector<Series> lines;
    for (std::size_t i = 0; i < records->size(); ++i) {
        const Json& r = (*records)[i];
        const std::string where = path + ": record " + std::to_string(i);
        if (!r.is_object()) throw InputError(where + ": not a JSON object");
        const std::string method = required_string(r, "method", where);
        const std::string target = optional_string(r, "target", where);
        optional_string(r, "fit", where);
        optional_string(r, "objective", where);
        const double bytes = optional_number(r, "bytes_per_token", where);
        const double heldout = optional_number(r, "heldout", where);
        for (const char* key : {"fitting", "compression_ratio", "delta_ppl"}) optional_number(r, key, where);
        auto line = std::find_if(lines.begin(), lines.end(), [&](const Series& s) { return s.label == method; });
        if (line == lines.end()) line = lines.insert(lines.end(), Series{method, {}});
        if (!std::isnan(bytes) && !std::isnan(heldout)) line->points.push_back({bytes, heldout, target});
    }
    Section section{"search.json", std::to_string(records->size()) + " records, objective " + objective, {}};
    for (Figure& f : line_figure("search-heldout", "search.json", lines, "method", objective,
                                 "held-out " + readable(objective), "bytes_per_token",
                                 "bytes per token (per layer and KV head)")) {
        f.title = "held-out " + readable(objective) + " against memory";
        section.figures.push_back(std::move(f));
    }
    return section;
}

// A per-(layer, KV head) array of profile.json: `layers` rows of `heads` numbers (null: no value).
std::vector<std::vector<double>> per_head(const Json& value, const std::string& key, const std::string& path,
                                          int layers, int heads) {
    const std::string where = path + ": '" + key + "'";
    if (!value.is_array() || value.size() != static_cast<std::size_t>(layers))
        throw InputError(where + " is not a list of " + std::to_string(layers) + " rows (one per layer)");
    std::vector<std::vector<double>> rows;
    for (std::size_t layer = 0; layer < value.size(); ++layer) {
        const Json& row = value[layer];
        if (!row.is_array() || row.size() != static_cast<std::size_t>(heads))
            throw InputError(where + " row " + std::to_string(layer) + " is not a list of " + std::to_string(heads) +
                             " values (one per KV head)");
        rows.emplace_back();
        for (std::size_t head = 0; head < row.size(); ++head) {
            if (!row[head].is_null() && !row[head].is_number())
                throw InputError(where + " row " + std::to_string(layer) + ", KV head " + std::to_string(head) +
                                 " is not a number");
            rows.back().push_back(row[head].is_null() ? NAN
                                                      : plottable(row[head].get<double>(), where + " row " +
                                                                      std::to_string(layer), "KV head " + std::to_string(head)));
        }
    }
    return rows;
}

Section profile_figures(const std::string& path) {
    // A profile is plotted only if it is one every other command would take (search/profile.h):
    // its format and every version this kvsim reads are checked there, once.
    const Profile profile = load_profile(path);
    const Json file = read_json(path);
    const std::string name = optional_string(file, "name", path);
    const auto model = file.find("model");
    if (model == file.end() || !model->is_object()) throw InputError(path + ": 'model' is not an object");
    const int layers = required_count(*model, "num_layers", path + ": 'model'");
    const int heads = required_count(*model, "num_kv_heads", path + ": 'model'");
    // profile.json, or one of a search's profile-<fit>-<target>.json: its stem names the figures.
    const std::string prefix = fs::path(path).stem().string();
    Section section{fs::path(path).filename().string(), "", {}};
    const std::string of = name.empty() ? "" : " of " + name;

    if (const auto budgets = file.find("layer_budgets"); budgets != file.end() && !budgets->is_null()) {
        if (!budgets->is_array() || budgets->size() != static_cast<std::size_t>(layers))
            throw InputError(path + ": 'layer_budgets' is not a list of " + std::to_string(layers) + " numbers");
        Figure f{prefix + "-layer_budgets", "layer budgets" + of, "Tokens kept per layer (layer_budgets)" + of + ".",
                 "", ""};
        f.data = "# kvsim report: layer_budgets from profile.json\n# columns: layer, budget (tokens)\n";
        for (int layer = 0; layer < layers; ++layer) {
            const Json& b = (*budgets)[layer];
            if (!b.is_number())
                throw InputError(path + ": 'layer_budgets' entry " + std::to_string(layer) + " is not a number");
            f.data += std::to_string(layer) + " " + number(b.get<double>()) + "\n";
        }
        f.plot = "set xlabel \"layer\"\nset ylabel \"budget (tokens per KV head)\"\nset xtics 1\nset xrange [-0.5:" +
                 std::to_string(layers) + " - 0.5]\nset yrange [0:*]\nset grid ytics\nset boxwidth 0.8\n" +
                 "set offsets 0, 0, graph 0.05, 0\nset style fill solid 0.6\n"
                 "plot \"" + f.name + ".dat\" using 1:2 with boxes notitle\n";
        section.figures.push_back(f);
    }
    auto add_heat_map = [&](const Json& value, const std::string& key, bool unit_range, const std::string& what) {
        std::string stem = key;
        std::replace(stem.begin(), stem.end(), '.', '-');
        section.figures.push_back(heat_map(prefix + "-" + stem, key, per_head(value, key, path, layers, heads),
                                           unit_range, what + " per (layer, KV head)" + of + "."));
        section.figures.back().title = key + of;
    };
    if (const auto budgets = file.find("head_budgets"); budgets != file.end() && !budgets->is_null())
        add_heat_map(*budgets, "head_budgets", false, "Tokens kept (head_budgets)");
    if (profile.mixed) {  // checked by load_profile: every head's method and level
        section.figures.push_back(method_map(prefix + "-mixed-method", *profile.mixed,
                                             "Each head's method (colour) and level (text: an eviction head's budget, "
                                             "a tier head's FP16/INT8/INT4 shares, a streaming head's lambda; "
                                             "mixed.method) per (layer, KV head)" + of + "."));
        section.figures.back().title = "mixed.method" + of;
    }
    if (const auto streaming = file.find("streaming"); streaming != file.end() && !streaming->is_null()) {
        if (!streaming->is_object()) throw InputError(path + ": 'streaming' is not an object");
        if (const auto h = streaming->find("heads"); h != streaming->end() && !h->is_null())
            add_heat_map(*h, "streaming.heads", true, "Streaming heads (1: streaming, 0: full cache; streaming.heads)");
        // lambda may be one value for every head: nothing to map then.
        if (const auto l = streaming->find("lambda"); l != streaming->end() && !l->is_null()) {
            if (l->is_array())
                add_heat_map(*l, "streaming.lambda", false, "Decay of the linear state (streaming.lambda)");
            else if (!l->is_number())
                throw InputError(path + ": 'streaming.lambda' is not a number or a list of rows");
        }
    }
    if (const auto tiers = file.find("tiers"); tiers != file.end() && !tiers->is_null()) {
        if (!tiers->is_object()) throw InputError(path + ": 'tiers' is not an object");
        for (const auto& [tier, shares] : tiers->items()) {
            // The key names the figure's files and goes into its gnuplot script: plain names only.
            if (tier.empty() || tier.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") != std::string::npos)
                throw InputError(path + ": 'tiers' has a key '" + one_line(tier) + "' that is not a plain name");
            add_heat_map(shares, "tiers." + tier, true, "Share of tokens held at " + tier.substr(0, tier.find('_')) +
                                                            " (tiers." + tier + ")");
        }
    }
    // What the profile promises, for the section's heading line.
    if (const auto expected = file.find("expected"); expected != file.end() && expected->is_object()) {
        const double bytes = optional_number(*expected, "bytes_per_token", path + ": 'expected'");
        const double ratio = optional_number(*expected, "compression_ratio", path + ": 'expected'");
        if (!std::isnan(bytes)) section.note += "expected " + short_number(bytes) + " bytes per token";
        if (!std::isnan(ratio))
            section.note += (section.note.empty() ? "expected " : ", ") + short_number(ratio) + "x compression";
    }
    if (const auto heldout = file.find("heldout"); heldout != file.end() && heldout->is_object()) {
        const double value = optional_number(*heldout, "value", path + ": 'heldout'");
        const std::string objective = optional_string(*heldout, "objective", path + ": 'heldout'");
        if (!std::isnan(value))
            section.note += (section.note.empty() ? "held-out " : "; held-out ") + objective + " " + short_number(value);
    }
    if (!name.empty()) section.note = name + (section.note.empty() ? "" : ": " + section.note);
    return section;
}

// ---- Writing: gnuplot found before anything is written, the figures built in a staging folder.

std::string find_gnuplot() {
    const char* path = std::getenv("PATH");
    std::stringstream dirs(path ? path : "");
    std::string dir;
    while (std::getline(dirs, dir, ':')) {
        const fs::path candidate = fs::path(dir.empty() ? "." : dir) / "gnuplot";
        std::error_code error;
        if (fs::is_regular_file(candidate, error) && ::access(candidate.c_str(), X_OK) == 0) return candidate.string();
    }
    throw InputError("gnuplot not found (apt-get install gnuplot-nox)");
}

// Runs gnuplot on the scripts inside `folder` (they name their files relative to it); throws
// with what gnuplot said when it fails. Its warnings on success (a range widened around a single
// point) are about kvsim's own scripts, not the user's input, and are dropped.
void run_gnuplot(const std::string& gnuplot, const std::string& folder, const std::vector<std::string>& scripts) {
    int out[2];
    if (::pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addchdir_np(&actions, folder.c_str());
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDERR_FILENO);
    std::vector<std::string> args{"gnuplot"};
    args.insert(args.end(), scripts.begin(), scripts.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    const int spawned = ::posix_spawn(&pid, gnuplot.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(out[1]);
    std::string said;
    char buffer[4096];
    for (ssize_t n; spawned == 0 && (n = ::read(out[0], buffer, sizeof buffer)) != 0;)
        if (n > 0) said.append(buffer, static_cast<std::size_t>(n));
        else if (errno != EINTR) break;
    ::close(out[0]);
    if (spawned != 0) throw std::runtime_error("cannot run " + gnuplot + ": " + std::strerror(spawned));
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        // Its last line says what failed (the lines before echo the script): one line, cut short.
        std::string last;
        std::stringstream lines(said);
        for (std::string line; std::getline(lines, line);)
            if (line.find_first_not_of(" \t^") != std::string::npos) last = line;
        last = one_line(last);
        if (last.size() > 200) last = last.substr(0, 197) + "...";
        throw std::runtime_error("gnuplot failed on kvsim's script in " + folder + ": " + last);
    }
}

// A staging folder that is removed unless it was renamed into place.
class StagingFolder {
public:
    explicit StagingFolder(const fs::path& dir) : path_(dir / (".plots.tmp-" + std::to_string(::getpid()))) {
        remove_stale(dir);
        std::error_code error;
        fs::remove_all(path_, error);
        if (!fs::create_directory(path_, error))
            throw InputError(path_.string() + ": cannot create (" + error.message() + ")");
    }
    ~StagingFolder() {
        std::error_code ignored;
        if (!done_) fs::remove_all(path_, ignored);
    }
    const fs::path& path() const { return path_; }

    // Puts the staged folder at `target`. An old target is swapped out in one step and removed
    // only then, so `target` is never missing or half-written.
    void move_to(const fs::path& target) {
        std::error_code error;
        if (fs::is_directory(target, error)) {
            if (::renameat2(AT_FDCWD, path_.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0)
                throw InputError(target.string() + ": cannot replace (" + std::strerror(errno) + ")");
            fs::remove_all(path_, error);  // now the old plots
        } else if (::rename(path_.c_str(), target.c_str()) != 0) {
            throw InputError(target.string() + ": cannot write (" + std::strerror(errno) + ")");
        }
        done_ = true;
    }

private:
    // Staging folders of report runs that were killed (their process no longer runs).
    static void remove_stale(const fs::path& dir) {
        std::error_code error;
        for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
            const std::string name = it->path().filename().string();
            const std::string digits = name.rfind(".plots.tmp-", 0) == 0 ? name.substr(11) : "";
            if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos)
                continue;
            if (::kill(static_cast<pid_t>(std::stol(digits)), 0) != 0 && errno == ESRCH) {
                std::error_code ignored;
                fs::remove_all(it->path(), ignored);
            }
        }
    }

    fs::path path_;
    bool done_ = false;
};

std::string report_page(const std::string& dir, const std::vector<Section>& sections) {
    std::string page = "# kvsim report: " + one_line(dir) + "\n\n" +
                       "Drawn by `kvsim report` with gnuplot. Beside each figure are its data (`NAME.dat`) and its "
                       "gnuplot script (`NAME.gp`): edit the script and run `gnuplot NAME.gp` in this folder to "
                       "redraw `NAME.svg` and `NAME.png`.\n";
    for (const Section& s : sections) {
        if (s.figures.empty()) continue;
        page += "\n## " + s.source + "\n\n";
        if (!s.note.empty()) page += one_line(s.note) + ".\n\n";
        for (const Figure& f : s.figures)
            page += "![" + one_line(f.title) + "](" + f.name + ".svg)\n\n" + one_line(f.caption) + "\n\n";
    }
    return page;
}

}  // namespace

namespace {

int figure_count(const std::vector<Section>& sections) {
    int figures = 0;
    for (const Section& s : sections) figures += static_cast<int>(s.figures.size());
    return figures;
}

// Every input of DIR read and checked, and its figures built: what write_report_plots draws.
std::vector<Section> read_sections(const std::string& dir) {
    std::error_code error;
    std::vector<Section> sections;
    const fs::path folder(dir);
    using Reader = Section (*)(const std::string& path);
    const std::pair<const char*, Reader> inputs[] = {
        {"results.json", results_figures}, {"search.json", search_figures}, {"profile.json", profile_figures}};
    for (const auto& [file, read] : inputs)
        if (fs::exists(folder / file, error)) sections.push_back(read((folder / file).string()));
    // A search folder also holds a profile per fit and target (profile-tiers-2x.json, ...).
    std::vector<std::string> more_profiles;
    for (const auto& entry : fs::directory_iterator(folder, error)) {
        const std::string file = entry.path().filename().string();
        if (file.rfind("profile-", 0) == 0 && entry.path().extension() == ".json" && entry.is_regular_file(error) &&
            file.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.") == std::string::npos)
            more_profiles.push_back(entry.path().string());
    }
    std::sort(more_profiles.begin(), more_profiles.end());
    for (const std::string& path : more_profiles) sections.push_back(profile_figures(path));
    if (sections.empty()) throw InputError(dir + ": no results.json, search.json or profile.json to plot");
    if (figure_count(sections) == 0)
        throw InputError(dir + ": nothing to plot (no finite metric values in " + sections[0].source +
                         (sections.size() > 1 ? " or the others" : "") + ")");
    return sections;
}

}  // namespace

int check_report_inputs(const std::string& dir) { return figure_count(read_sections(dir)); }

int write_report_plots(const std::string& dir) {
    std::error_code error;
    if (!fs::is_directory(dir, error))
        throw InputError(dir + (fs::exists(dir, error) ? ": not a folder" : ": no such folder"));
    // No other kvsim writes the folder's results (or plots) while they are read and drawn; a commit
    // a killed run left half done is completed first.
    const OutputFolder lock(dir);
    // Read and check every input before anything is written.
    const std::vector<Section> sections = read_sections(dir);
    const int figures = figure_count(sections);
    const fs::path folder(dir);
    const std::string gnuplot = find_gnuplot();
    const fs::path target = folder / "plots";
    if (fs::exists(target, error) && !fs::is_directory(target, error))
        throw InputError(target.string() + ": exists and is not a folder");

    StagingFolder staging(folder);
    std::vector<std::string> scripts;
    for (const Section& s : sections) {
        for (const Figure& f : s.figures) {
            write_file_atomically((staging.path() / (f.name + ".dat")).string(), f.data);
            write_file_atomically((staging.path() / (f.name + ".gp")).string(), figure_script(f));
            scripts.push_back(f.name + ".gp");
        }
    }
    run_gnuplot(gnuplot, staging.path().string(), scripts);
    for (const Section& s : sections)
        for (const Figure& f : s.figures)
            for (const char* ext : {".svg", ".png"})
                if (fs::file_size(staging.path() / (f.name + ext), error) == 0 || error)
                    throw std::runtime_error("gnuplot wrote no " + f.name + ext);
    write_file_atomically((staging.path() / "report.md").string(), report_page(dir, sections));
    staging.move_to(target);
    return figures;
}

}  // namespace kvsim
