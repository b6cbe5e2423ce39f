#include <doctest/doctest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "base/input_file.h"
#include "base/size_limits.h"

using namespace kvsim;

namespace {
std::filesystem::path fresh_dir(const char* name) {
    const std::filesystem::path dir = std::filesystem::path(KVSIM_TEST_TMP) / name;
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    return dir;
}
void touch(const std::filesystem::path& path) { std::ofstream(path) << "x"; }
}  // namespace

TEST_CASE("sizes from input: parsed with units, checked against the memory limit, never wrapped") {
    CHECK(parse_byte_size("512M", "--max-memory") == 512ull << 20);
    CHECK(parse_byte_size("1.5GiB", "--max-memory") == 3ull << 29);
    CHECK(parse_byte_size("4096", "--max-memory") == 4096);
    for (const char* bad : {"", "G", "12Q", "-1G", "0", "nan", "1e30G", "8 G"})
        CHECK_THROWS_AS(parse_byte_size(bad, "--max-memory"), InputError);

    const uint64_t saved = memory_limit_bytes();
    CHECK(saved > 0);
    set_memory_limit_bytes(1 << 20);
    CHECK_NOTHROW(check_memory(1 << 20, "x.h5: dataset 'q'"));
    CHECK_THROWS_WITH_AS(check_memory((1 << 20) + 1, "x.h5: dataset 'q'"),
                         "x.h5: dataset 'q' needs 1.0 MiB, over the memory limit of 1.0 MiB (--max-memory)", InputError);
    set_memory_limit_bytes(saved);

    CHECK(checked_mul(1ull << 31, 1ull << 32, "shape") == 1ull << 63);
    CHECK_THROWS_WITH_AS(checked_mul(1ull << 32, 1ull << 32, "tensor 'w'"), "tensor 'w': size overflows 64 bits",
                         InputError);
    CHECK_THROWS_AS(checked_add(UINT64_MAX - 14175, 14176, "offset"), InputError);
    CHECK(checked_add(UINT64_MAX - 14176, 14176, "offset") == UINT64_MAX);
    CHECK(checked_narrow<int>(int64_t{2147483647}, "k") == 2147483647);
    CHECK_THROWS_WITH_AS(checked_narrow<int>(int64_t{4294967297}, "key_length"),
                         "key_length: 4294967297 is out of range [-2147483648, 2147483647]", InputError);
    CHECK_THROWS_AS(checked_narrow<uint32_t>(-1, "n"), InputError);
}

TEST_CASE("input files must be regular files") {
    const auto dir = fresh_dir("regular_files");
    touch(dir / "ok.yaml");
    CHECK_NOTHROW(require_regular_file((dir / "ok.yaml").string()));
    CHECK_THROWS_WITH_AS(require_regular_file((dir / "none.yaml").string()), ((dir / "none.yaml").string() + ": no such file").c_str(),
                         InputError);
    CHECK_THROWS_WITH_AS(require_regular_file(dir.string()), (dir.string() + ": is a directory, not a file").c_str(),
                         InputError);
    REQUIRE(::mkfifo((dir / "fifo").c_str(), 0600) == 0);
    CHECK_THROWS_WITH_AS(require_regular_file((dir / "fifo").string()),
                         ((dir / "fifo").string() + ": is a FIFO, not a regular file").c_str(), InputError);
    CHECK_THROWS_AS(require_regular_file((dir / std::string(300, 'a')).string()), InputError);
    CHECK_THROWS_AS(require_regular_file((dir / "ok.yaml" / "below").string()), InputError);
    CHECK_THROWS_AS(require_regular_file(""), InputError);
}

TEST_CASE("a file read many times is parsed once while its bytes stay the same") {
    const auto dir = fresh_dir("parsed_once");
    const std::string a = (dir / "a.yaml").string(), b = (dir / "b.yaml").string();
    std::ofstream(a) << "plan 1";
    std::ofstream(b) << "plan 1";
    int parses = 0;
    auto parse = [&](const std::string& text) {
        ++parses;
        if (text == "bad") throw InputError("cannot parse: " + text);
        return text + " parsed";
    };
    CHECK(parsed_once<std::string>(a, "k", parse) == "plan 1 parsed");
    CHECK(parsed_once<std::string>(a, "k", parse) == "plan 1 parsed");
    CHECK(parsed_once<std::string>(b, "k", parse) == "plan 1 parsed");  // the same bytes elsewhere
    CHECK(parses == 1);
    CHECK(parsed_once<std::string>(a, "other key", parse) == "plan 1 parsed");
    CHECK(parses == 2);
    std::ofstream(a) << "plan 2";  // new bytes at the same path: parsed again
    CHECK(parsed_once<std::string>(a, "k", parse) == "plan 2 parsed");
    CHECK(parses == 3);
    std::ofstream(a) << "bad";  // a failure is not kept: it fails every time
    CHECK_THROWS_AS(parsed_once<std::string>(a, "k", parse), InputError);
    CHECK_THROWS_AS(parsed_once<std::string>(a, "k", parse), InputError);
    CHECK(parses == 5);
    CHECK_THROWS_AS(parsed_once<std::string>((dir / "none.yaml").string(), "k", parse), InputError);
}

TEST_CASE("atomic files: the temporary name, commit, and the leftovers of dead processes") {
    const auto dir = fresh_dir("atomic_files");
    const std::string target = (dir / "out.json").string();
    {
        AtomicFile file(target);
        CHECK(file.temp_path() == (dir / (".out.json.tmp-" + std::to_string(::getpid()))).string());
        file.write("{}");
        CHECK(std::filesystem::exists(file.temp_path()));
        CHECK_FALSE(std::filesystem::exists(target));
    }  // not committed: the temporary file goes, nothing appears
    CHECK(std::filesystem::is_empty(dir));
    write_file_atomically(target, "[]");
    CHECK(std::filesystem::exists(target));

    // A process that has exited: its pid is free (until reused, which a fresh child's is not).
    const pid_t child = ::fork();
    if (child == 0) ::_exit(0);
    REQUIRE(child > 0);
    ::waitpid(child, nullptr, 0);
    touch(atomic_temp_path((dir / "trace.h5").string(), child));
    touch(atomic_temp_path((dir / "mine.h5").string(), ::getpid()));  // a live writer's
    touch(dir / ".notes.tmp-abc");                                     // not one of ours
    touch(dir / "plain.tmp-1");                                        // not hidden: not ours
    CHECK(remove_stale_temp_files(dir.string()) == 1);
    CHECK_FALSE(std::filesystem::exists(atomic_temp_path((dir / "trace.h5").string(), child)));
    CHECK(std::filesystem::exists(atomic_temp_path((dir / "mine.h5").string(), ::getpid())));
    CHECK(std::filesystem::exists(dir / ".notes.tmp-abc"));
    CHECK(std::filesystem::exists(dir / "plain.tmp-1"));
    CHECK_THROWS_AS(AtomicFile(""), InputError);

    // A temporary folder goes with its object; one a killed run left is removed by the next run
    // of the same kind, while a live process's stays.
    const std::filesystem::path temp = std::filesystem::temp_directory_path();
    const std::filesystem::path dead = temp / ("kvsim-basetest-" + std::to_string(child));
    const std::filesystem::path live = temp / "kvsim-basetest-1";  // init: always running
    std::filesystem::create_directories(dead);
    std::filesystem::create_directories(live);
    touch(dead / "plan.yaml");
    std::string made;
    {
        const TempFolder folder("basetest");
        made = folder.path();
        CHECK(made == (temp / ("kvsim-basetest-" + std::to_string(::getpid()))).string());
        CHECK(std::filesystem::is_directory(made));
        touch(std::filesystem::path(made) / "plan.yaml");
        CHECK_FALSE(std::filesystem::exists(dead));
        CHECK(std::filesystem::exists(live));
    }
    CHECK_FALSE(std::filesystem::exists(made));
    std::filesystem::remove_all(live);
}
