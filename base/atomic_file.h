// Output files appear whole or not at all: write to a temporary name beside the target, rename
// when complete. A failed or interrupted run leaves no half-written file under the real name:
// SIGINT and SIGTERM remove the live temporary files before the process ends, and the temporary
// files that a killed process (SIGKILL, a lost node) left behind are removed by the next write
// to the same folder.
#pragma once
#include <string>

namespace kvsim {

class AtomicFile {
public:
    explicit AtomicFile(std::string path);
    ~AtomicFile();  // removes the temporary file unless commit() succeeded
    AtomicFile(const AtomicFile&) = delete;
    AtomicFile& operator=(const AtomicFile&) = delete;

    const std::string& temp_path() const { return temp_path_; }
    const std::string& path() const { return path_; }
    void write(const std::string& contents);  // writes the whole temporary file
    void commit();  // renames the temporary file to the real name
    // Leaves the temporary file for someone else to rename (a commit journal names it): neither the
    // destructor nor a signal removes it.
    void keep_temp_file();

private:
    std::string path_;
    std::string temp_path_;
    int cleanup_slot_ = -1;  // this file's entry in the signal handler's list
    bool committed_ = false;
};

// A path the signal handler removes with the temporary files while the object lives (a folder's
// lock file, base/output_folder.h).
class RemovedOnSignal {
public:
    explicit RemovedOnSignal(std::string path);
    ~RemovedOnSignal();
    RemovedOnSignal(const RemovedOnSignal&) = delete;
    RemovedOnSignal& operator=(const RemovedOnSignal&) = delete;

private:
    std::string path_;
    int slot_ = -1;
};

// While an object lives, SIGINT, SIGTERM and SIGHUP wait: a run's last steps that must happen
// together (the renames of a folder's files, base/output_folder.h) finish, then the last object to
// go removes the live temporary files and ends the process as the signal would have. Whichever
// thread the signal lands on.
class SignalsHeld {
public:
    SignalsHeld();
    ~SignalsHeld();
    SignalsHeld(const SignalsHeld&) = delete;
    SignalsHeld& operator=(const SignalsHeld&) = delete;
};

// The journal of a folder's commit in progress (base/output_folder.h): while it exists, the
// temporary files in that folder are left for the next writer to complete.
inline constexpr const char* kCommitJournalName = ".kvsim-commit";

// A private folder under the system's temporary directory ("kvsim-<what>-<pid>"), removed with
// everything in it when the object goes: scratch files another component reads by path. A run
// killed before that (SIGTERM, SIGKILL) leaves its folder; the next one of the same kind removes
// the folders of processes that are gone.
class TempFolder {
public:
    explicit TempFolder(const std::string& what);
    ~TempFolder();
    TempFolder(const TempFolder&) = delete;
    TempFolder& operator=(const TempFolder&) = delete;
    const std::string& path() const { return path_; }

private:
    std::string path_;
};

// Writes `contents` to `path` atomically; throws InputError naming the path on failure.
void write_file_atomically(const std::string& path, const std::string& contents);

// The temporary name AtomicFile uses for `path` in process `pid`: ".<name>.tmp-<pid>" beside it.
std::string atomic_temp_path(const std::string& path, long pid);

// Removes ".<name>.tmp-<pid>" files in `folder` whose process no longer runs; returns how many.
int remove_stale_temp_files(const std::string& folder);

}  // namespace kvsim
