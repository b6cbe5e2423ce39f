// Output folders: one writer at a time, and a command's files replace the old ones together.
//
// A command that writes into a folder (run, sweep, merge, eval, search, report, export) holds the
// folder's lock while it runs: a second kvsim writing into the same folder is refused at once,
// with one line naming the folder, rather than left to mix its files with the first one's. The
// shards of one sweep or search share the folder (each writes only its own partial file); a
// command writing the folder's results excludes them. The lock is flock(2) on `.kvsim-lock` in the
// folder, removed again by the last holder; the kernel releases it when a process dies, so a
// killed run never leaves the folder locked.
//
// A command's files (results.csv and results.json; a search's search.json, profiles, CSV and
// report) are written whole under temporary names, then renamed into place one after another under
// a journal, `.kvsim-commit`, naming every rename. SIGINT, SIGTERM and SIGHUP wait until the last
// rename; a process killed between two renames (SIGKILL, a lost node) leaves the journal, and the
// next kvsim that takes the folder's lock completes the renames before it reads or writes anything
// there. So a folder holds every file of one commit or of the one before it, never a mix.
#pragma once
#include <memory>
#include <string>
#include <vector>

namespace kvsim {

class AtomicFile;

class OutputFolder {
public:
    enum class Access { exclusive, shared };
    // Creates `dir` where missing and takes its lock; InputError naming the folder when another
    // kvsim holds it (exclusive access: any other holder; shared: an exclusive one). An exclusive
    // holder completes a commit a killed process left half done. Within one process the lock is
    // taken once: an OutputFolder of a folder the process already holds is a second reference.
    explicit OutputFolder(const std::string& dir, Access access = Access::exclusive);
    // Releases the lock; a folder this object created is removed again when nothing was written
    // into it (bad input found before the first file).
    ~OutputFolder();
    OutputFolder(const OutputFolder&) = delete;
    OutputFolder& operator=(const OutputFolder&) = delete;
    const std::string& path() const { return dir_; }

private:
    std::string dir_;
    std::string key_;  // the folder's canonical path, for the process's table of held locks
    bool made_ = false;
};

// Files that replace their namesakes in one folder together (see above). Holds the folder's lock
// (exclusive) from construction to destruction.
class FolderCommit {
public:
    explicit FolderCommit(const std::string& dir);
    ~FolderCommit();
    // Writes `contents` whole under a temporary name in the folder; `name` is a plain file name.
    void add(const std::string& name, const std::string& contents);
    // Renames every added file into place under the journal; InputError naming the file on failure.
    void commit();

private:
    OutputFolder folder_;
    std::vector<std::string> names_;
    std::vector<std::unique_ptr<AtomicFile>> files_;
};

// Completes the renames a journal in `dir` names (a commit a killed process left half done) and
// removes the journal; returns whether there was one. The caller holds the folder's lock.
bool complete_interrupted_commit(const std::string& dir);

}  // namespace kvsim
