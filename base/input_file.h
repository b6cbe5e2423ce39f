// Files the user names as input (configs, profiles, traces, models, texts) must be regular
// files: a directory would fail deep inside a parser, and a FIFO or device would block forever.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace kvsim {

// Throws InputError naming the path when it is missing, a directory, a FIFO, socket or device,
// unreadable, or its name is too long for the system (with the system's reason).
void require_regular_file(const std::string& path);

// The whole file, after require_regular_file: InputError naming the path when it cannot be read.
std::string read_input_file(const std::string& path);

// A small file read many times over: a search's plan file is read by every (sequence, layer, KV
// head) harness of a pass, thousands of times, always the same bytes. parse(text) of the file's
// bytes, parsed once while they stay the same (`key`: what else the result depends on). A parse
// that throws is not kept, so a bad file fails every time with its own message. Thread-safe; the
// last 64 results are kept.
template <class T, class Parse>
T parsed_once(const std::string& path, const std::string& key, Parse&& parse) {
    static std::mutex mutex;
    static std::map<std::string, std::shared_ptr<const T>> parsed;
    const std::string text = read_input_file(path);
    const std::string lookup = key + '\0' + text;
    {
        const std::lock_guard lock(mutex);
        if (const auto it = parsed.find(lookup); it != parsed.end()) return *it->second;
    }
    auto value = std::make_shared<const T>(parse(text));
    const std::lock_guard lock(mutex);
    if (parsed.size() >= 64) parsed.clear();
    parsed.emplace(lookup, value);
    return *value;
}

}  // namespace kvsim
