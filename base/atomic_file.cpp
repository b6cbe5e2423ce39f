#include "base/atomic_file.h"

#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>

#include "base/errors.h"

namespace kvsim {
namespace {

// The temporary files this process is writing, for the signal handler: a fixed array of
// pointers it can read without locks or allocation (unlink is async-signal-safe).
constexpr int kCleanupSlots = 64;
std::array<std::atomic<const char*>, kCleanupSlots> live_temp_files{};

// While a SignalsHeld lives (depth > 0), the handler notes the signal and returns; the last
// SignalsHeld to go then acts on it. Lock-free atomics: safe in a handler.
std::atomic<int> hold_depth{0};
std::atomic<int> held_signal{0};

extern "C" void remove_temp_files_and_exit(int signal_number) {
    if (hold_depth.load() > 0) {
        held_signal.store(signal_number);
        return;
    }
    for (auto& slot : live_temp_files)
        if (const char* path = slot.load()) ::unlink(path);
    // Die of the same signal, so the parent sees how the process ended.
    ::signal(signal_number, SIG_DFL);
    ::raise(signal_number);
}

void install_handlers_once() {
    static std::once_flag once;
    std::call_once(once, [] {
        for (int signal_number : {SIGINT, SIGTERM, SIGHUP}) {
            struct sigaction current {};
            ::sigaction(signal_number, nullptr, &current);
            if (current.sa_handler == SIG_IGN) continue;  // e.g. nohup: keep ignoring it
            struct sigaction action {};
            action.sa_handler = remove_temp_files_and_exit;
            sigemptyset(&action.sa_mask);
            ::sigaction(signal_number, &action, nullptr);
        }
    });
}

}  // namespace

SignalsHeld::SignalsHeld() {
    install_handlers_once();
    hold_depth.fetch_add(1);
}

SignalsHeld::~SignalsHeld() {
    if (hold_depth.fetch_sub(1) != 1) return;
    if (const int signal_number = held_signal.exchange(0)) remove_temp_files_and_exit(signal_number);
}

namespace {

int register_temp_file(const char* path) {
    install_handlers_once();
    for (int i = 0; i < kCleanupSlots; ++i) {
        const char* expected = nullptr;
        if (live_temp_files[i].compare_exchange_strong(expected, path)) return i;
    }
    return -1;  // more than 64 files at once: still removed by the destructor and by the next run
}

bool process_is_gone(long pid) { return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH; }

}  // namespace

RemovedOnSignal::RemovedOnSignal(std::string path) : path_(std::move(path)) {
    slot_ = register_temp_file(path_.c_str());
}

RemovedOnSignal::~RemovedOnSignal() {
    if (slot_ >= 0) live_temp_files[slot_].store(nullptr);
}

std::string atomic_temp_path(const std::string& path, long pid) {
    const std::filesystem::path p(path);
    return (p.parent_path() / ("." + p.filename().string() + ".tmp-" + std::to_string(pid))).string();
}

int remove_stale_temp_files(const std::string& folder) {
    int removed = 0;
    std::error_code error;
    const std::filesystem::path dir = folder.empty() ? std::filesystem::path(".") : std::filesystem::path(folder);
    // A commit a killed process left half done: its temporary files are what the next writer of the
    // folder renames into place (base/output_folder.h), so they stay until then.
    if (std::filesystem::exists(dir / kCommitJournalName, error)) return 0;
    for (std::filesystem::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
        const std::string name = it->path().filename().string();
        const auto mark = name.rfind(".tmp-");
        if (name.size() < 2 || name[0] != '.' || mark == std::string::npos || mark == 0) continue;
        const std::string digits = name.substr(mark + 5);
        if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 9)
            continue;
        if (!process_is_gone(std::stol(digits))) continue;
        std::error_code ignored;
        if (it->is_regular_file(ignored) && std::filesystem::remove(it->path(), ignored)) ++removed;
    }
    return removed;
}

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
    if (path_.empty()) throw InputError("an empty output file name was given");
    temp_path_ = atomic_temp_path(path_, ::getpid());
    remove_stale_temp_files(std::filesystem::path(path_).parent_path().string());
    cleanup_slot_ = register_temp_file(temp_path_.c_str());
}

AtomicFile::~AtomicFile() {
    if (cleanup_slot_ >= 0) live_temp_files[cleanup_slot_].store(nullptr);
    if (!committed_) std::remove(temp_path_.c_str());
}

void AtomicFile::commit() {
    if (std::rename(temp_path_.c_str(), path_.c_str()) != 0)
        throw InputError(path_ + ": cannot write (" + std::strerror(errno) + ")");
    committed_ = true;
    if (cleanup_slot_ >= 0) live_temp_files[cleanup_slot_].store(nullptr);
    cleanup_slot_ = -1;
}

void AtomicFile::keep_temp_file() {
    committed_ = true;  // the destructor leaves the temporary file
    if (cleanup_slot_ >= 0) live_temp_files[cleanup_slot_].store(nullptr);
    cleanup_slot_ = -1;
}

void AtomicFile::write(const std::string& contents) {
    std::ofstream out(temp_path_, std::ios::binary);
    out << contents;
    out.close();
    if (!out) throw InputError(path_ + ": cannot write (" + std::strerror(errno) + ")");
}

void write_file_atomically(const std::string& path, const std::string& contents) {
    AtomicFile file(path);
    file.write(contents);
    file.commit();
}

TempFolder::TempFolder(const std::string& what) {
    std::error_code ec;
    const std::filesystem::path folder =
        std::filesystem::temp_directory_path(ec) / ("kvsim-" + what + "-" + std::to_string(::getpid()));
    if (ec) throw InputError("cannot find a temporary folder (" + ec.message() + "); set TMPDIR");
    // The folders of earlier runs that were killed before they could remove theirs.
    const std::string prefix = "kvsim-" + what + "-";
    for (const auto& entry : std::filesystem::directory_iterator(folder.parent_path(), ec)) {
        const std::string name = entry.path().filename().string();
        if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size() ||
            name.find_first_not_of("0123456789", prefix.size()) != std::string::npos)
            continue;
        std::error_code ignored;
        if (process_is_gone(std::stol(name.substr(prefix.size())))) std::filesystem::remove_all(entry.path(), ignored);
    }
    std::filesystem::create_directories(folder, ec);
    if (ec) throw InputError(folder.string() + ": cannot create a temporary folder (" + ec.message() + ")");
    path_ = folder.string();
}

TempFolder::~TempFolder() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
}

}  // namespace kvsim
