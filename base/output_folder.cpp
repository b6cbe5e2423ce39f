#include "base/output_folder.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "base/input_file.h"
#include "base/json_file.h"

namespace kvsim {
namespace {

namespace fs = std::filesystem;
constexpr const char* kLockName = ".kvsim-lock";

// The folders this process holds, by canonical path: a lock is taken once per process.
struct HeldLock {
    int fd = -1;  // -1: the file system cannot lock; the folder is held all the same
    OutputFolder::Access access = OutputFolder::Access::exclusive;
    int references = 0;
    // An exclusive holder's lock file goes with it when a signal ends the process (a shared
    // holder's stays: the other holders still hold it).
    std::shared_ptr<RemovedOnSignal> removed_on_signal;
};
std::mutex held_mutex;
std::map<std::string, HeldLock>& held_locks() {
    static std::map<std::string, HeldLock> locks;
    return locks;
}

std::string error_text(int error) { return std::strerror(error); }

// Where the environment variable `variable` holds SECONDS, stops that long, saying on stderr that
// it is paused `where`, so the tests can act in that moment:
// - KVSIM_TEST_COMMIT_PAUSE: a commit after its first rename, to interrupt it there
//   (tests/cli_results_test.py);
// - KVSIM_TEST_UNLOCK_PAUSE: a shared holder that finds itself the last, holding the lock alone,
//   to start another there (tests/cli_integrity_test.py).
void pause_for_tests(const char* variable, const std::string& where) {
    const char* pause = std::getenv(variable);
    if (!pause || !*pause) return;
    std::fprintf(stderr, "kvsim: test: paused %s\n", where.c_str());
    std::fflush(stderr);
    std::this_thread::sleep_for(std::chrono::duration<double>(std::atof(pause)));
}

// A shared holder that leaves takes the lock alone for a moment, to see whether it is the last
// (unlock_folder): a process meeting that moment (a shard starting as another of the same folder
// ends, a merge started as the last shard ends) tries again for this long before it takes the
// lock for a writer's, which holds it for the whole of its run.
constexpr auto kLockPatience = std::chrono::milliseconds(500);

// Opens and locks DIR/.kvsim-lock. A holder removes the file as it releases it, so the file locked
// must still be the one at that name; else another process got there between open and lock.
int lock_folder(const std::string& dir, OutputFolder::Access access) {
    const std::string path = (fs::path(dir) / kLockName).string();
    const auto give_up = std::chrono::steady_clock::now() + kLockPatience;
    for (;;) {
        const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (fd < 0) throw InputError(dir + ": cannot write into this folder (" + error_text(errno) + ")");
        const int mode = access == OutputFolder::Access::exclusive ? LOCK_EX : LOCK_SH;
        if (::flock(fd, mode | LOCK_NB) != 0) {
            const int error = errno;
            ::close(fd);
            if (error == EWOULDBLOCK && std::chrono::steady_clock::now() < give_up) {
                std::this_thread::sleep_for(std::chrono::milliseconds(10));
                continue;
            }
            if (error == EWOULDBLOCK)
                throw InputError(dir + ": another kvsim is writing into this folder; wait until it ends, or give "
                                       "another output folder");
            if (error == ENOLCK || error == EOPNOTSUPP || error == ENOSYS || error == EINVAL) {
                std::fprintf(stderr, "kvsim: warning: %s: this file system cannot lock files (%s); nothing stops "
                                     "a second kvsim writing into the folder at the same time\n",
                             dir.c_str(), error_text(error).c_str());
                ::unlink(path.c_str());
                return -1;
            }
            throw InputError(dir + ": cannot lock the folder (" + error_text(error) + ")");
        }
        struct stat opened {}, named {};
        if (::fstat(fd, &opened) == 0 && ::stat(path.c_str(), &named) == 0 && opened.st_dev == named.st_dev &&
            opened.st_ino == named.st_ino)
            return fd;
        ::close(fd);  // released and removed by its holder meanwhile: lock the new one
    }
}

void unlock_folder(const std::string& dir, const HeldLock& held) {
    if (held.fd < 0) return;
    // The last holder removes the file. A shared holder is the last when it can take the lock
    // alone; the exchange is not atomic, and one that fails leaves the file to the others.
    if (held.access == OutputFolder::Access::exclusive) {
        ::unlink((fs::path(dir) / kLockName).string().c_str());
    } else if (::flock(held.fd, LOCK_EX | LOCK_NB) == 0) {
        pause_for_tests("KVSIM_TEST_UNLOCK_PAUSE", "holding " + dir + "'s lock alone");
        ::unlink((fs::path(dir) / kLockName).string().c_str());
    }
    ::close(held.fd);
}

// A plain file name: no folder part, not "." or "..".
bool plain_name(const std::string& name) {
    return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
           name.find('\0') == std::string::npos;
}

}  // namespace

OutputFolder::OutputFolder(const std::string& dir, Access access) : dir_(dir) {
    if (dir_.empty()) throw InputError("an empty output folder name was given");
    std::error_code ec;
    if (!fs::is_directory(dir_, ec)) {
        if (fs::exists(dir_, ec)) throw InputError(dir_ + ": cannot create output folder (exists and is not a folder)");
        fs::create_directories(dir_, ec);
        if (ec) throw InputError(dir_ + ": cannot create output folder (" + ec.message() + ")");
        made_ = true;
    }
    key_ = fs::weakly_canonical(dir_, ec).string();
    if (ec) key_ = fs::absolute(dir_).lexically_normal().string();
    std::lock_guard<std::mutex> guard(held_mutex);
    auto& locks = held_locks();
    if (const auto it = locks.find(key_); it != locks.end()) {
        if (it->second.access == Access::shared && access == Access::exclusive)
            throw std::logic_error(dir_ + ": held shared, wanted exclusive");
        ++it->second.references;
        made_ = false;  // the first holder removes it
        return;
    }
    HeldLock held;
    held.access = access;
    held.references = 1;
    try {
        {
            const SignalsHeld signals;  // a signal between creating the lock file and registering it waits
            held.fd = lock_folder(dir_, access);
            if (access == Access::exclusive && held.fd >= 0)
                held.removed_on_signal = std::make_shared<RemovedOnSignal>((fs::path(dir_) / kLockName).string());
        }
        if (access == Access::exclusive) complete_interrupted_commit(dir_);
    } catch (...) {
        held.removed_on_signal.reset();
        unlock_folder(dir_, held);
        if (made_) fs::remove(dir_, ec);
        throw;
    }
    locks[key_] = held;
}

OutputFolder::~OutputFolder() {
    std::lock_guard<std::mutex> guard(held_mutex);
    auto& locks = held_locks();
    const auto it = locks.find(key_);
    if (it == locks.end() || --it->second.references > 0) return;
    {
        const SignalsHeld signals;
        it->second.removed_on_signal.reset();  // before the file goes: another process may make the next one
        unlock_folder(dir_, it->second);
    }
    locks.erase(it);
    std::error_code ec;
    if (made_ && fs::is_empty(dir_, ec)) fs::remove(dir_, ec);
}

bool complete_interrupted_commit(const std::string& dir) {
    const std::string journal = (fs::path(dir) / kCommitJournalName).string();
    std::error_code ec;
    if (!fs::exists(journal, ec)) return false;
    const nlohmann::json j = load_json_file(journal);
    const auto files = j.is_object() ? j.find("files") : j.end();
    if (files == j.end() || !files->is_array())
        throw InputError(journal + ": not a kvsim commit journal ('files' is not a list); remove it by hand");
    for (const auto& entry : *files) {
        if (!entry.is_array() || entry.size() != 2 || !entry[0].is_string() || !entry[1].is_string() ||
            !plain_name(entry[0].get<std::string>()) || !plain_name(entry[1].get<std::string>()) ||
            entry[0].get<std::string>().rfind(".", 0) != 0)
            throw InputError(journal + ": not a kvsim commit journal (an entry of 'files' is not [temporary name, "
                                       "name]); remove it by hand");
        const fs::path from = fs::path(dir) / entry[0].get<std::string>();
        const fs::path to = fs::path(dir) / entry[1].get<std::string>();
        if (!fs::exists(from, ec)) continue;  // renamed before the process was killed
        if (std::rename(from.c_str(), to.c_str()) != 0)
            throw InputError(to.string() + ": cannot write (" + error_text(errno) + ") completing " + journal);
    }
    if (std::remove(journal.c_str()) != 0)
        throw InputError(journal + ": cannot remove (" + error_text(errno) + ")");
    return true;
}

FolderCommit::FolderCommit(const std::string& dir) : folder_(dir) {}

FolderCommit::~FolderCommit() = default;

void FolderCommit::add(const std::string& name, const std::string& contents) {
    if (!plain_name(name)) throw std::logic_error("FolderCommit: '" + name + "' is not a plain file name");
    files_.push_back(std::make_unique<AtomicFile>((fs::path(folder_.path()) / name).string()));
    files_.back()->write(contents);
    names_.push_back(name);
}

void FolderCommit::commit() {
    if (files_.empty()) return;
    const SignalsHeld held;  // from the journal to the last rename, a signal waits
    nlohmann::json entries = nlohmann::json::array();
    for (std::size_t i = 0; i < files_.size(); ++i)
        entries.push_back({fs::path(files_[i]->temp_path()).filename().string(), names_[i]});
    const std::string journal = (fs::path(folder_.path()) / kCommitJournalName).string();
    if (files_.size() > 1)
        write_file_atomically(journal, nlohmann::json{{"format", "kvsim-commit"}, {"files", entries}}.dump() + "\n");
    for (std::size_t i = 0; i < files_.size(); ++i) {
        try {
            files_[i]->commit();
        } catch (const InputError& e) {
            if (i == 0) {
                std::remove(journal.c_str());  // nothing renamed: the old files stand
                throw;
            }
            // Some files are in place and not the rest: leave the journal and the temporary files
            // for the next writer to complete.
            for (std::size_t rest = i; rest < files_.size(); ++rest) files_[rest]->keep_temp_file();
            throw InputError(std::string(e.what()) + "; " + std::to_string(i) + " of " +
                             std::to_string(files_.size()) + " files were replaced, and the next kvsim writing into " +
                             folder_.path() + " completes the rest");
        }
        if (i == 0 && files_.size() > 1)
            pause_for_tests("KVSIM_TEST_COMMIT_PAUSE", "between two renames in " + folder_.path());
    }
    if (files_.size() > 1 && std::remove(journal.c_str()) != 0)
        throw InputError(journal + ": cannot remove (" + error_text(errno) + ")");
    files_.clear();
    names_.clear();
}

}  // namespace kvsim
