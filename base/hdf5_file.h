// HDF5 files kvsim writes and reads (traces, K/V bases): owned identifiers, attributes written
// as kvsim writes them, and a reader that checks every attribute and dataset it opens, reporting
// one line (InputError "<file>: <what>") instead of HDF5's error stack.
#pragma once
#include <hdf5.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvsim {

// HDF5 prints its error stack to stderr by default; kvsim reports one line of its own instead.
// Debian's HDF5 is a thread-safe build, which keeps that setting per thread: the main thread's is
// set at startup, and a thread that calls HDF5 (a layer read beside the replay) sets its own.
void silence_hdf5_here();

// True when the file starts with HDF5's signature (a regular file; false for anything else).
bool has_hdf5_signature(const std::string& path);

// Owns one HDF5 identifier and closes it with the matching function.
class Hdf5Handle {
public:
    using Closer = herr_t (*)(hid_t);
    Hdf5Handle() = default;
    Hdf5Handle(hid_t id, Closer close) : id_(id), close_(close) {}
    Hdf5Handle(Hdf5Handle&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
    Hdf5Handle& operator=(Hdf5Handle&& o) noexcept {
        reset();
        id_ = o.id_;
        close_ = o.close_;
        o.id_ = -1;
        return *this;
    }
    ~Hdf5Handle() { reset(); }
    hid_t get() const { return id_; }
    bool valid() const { return id_ >= 0; }
    void reset() {
        if (id_ >= 0 && close_) close_(id_);
        id_ = -1;
    }

private:
    hid_t id_ = -1;
    Closer close_ = nullptr;
};

Hdf5Handle hdf5_group(hid_t id);
Hdf5Handle hdf5_dataset(hid_t id);
Hdf5Handle hdf5_space(hid_t id);
Hdf5Handle hdf5_type(hid_t id);
Hdf5Handle hdf5_attr(hid_t id);
Hdf5Handle hdf5_plist(hid_t id);

// Attributes as kvsim writes them: fixed-length null-padded strings, int64, float64 arrays.
void write_string_attr(hid_t obj, const char* name, const std::string& value);
void write_int_attr(hid_t obj, const char* name, int64_t value);
void write_double_array_attr(hid_t obj, const char* name, const std::vector<double>& values);
void write_int_array_attr(hid_t obj, const char* name, const std::vector<int64_t>& values);

// "[2, 3]"
std::string show_shape(const std::vector<hsize_t>& dims);

// An HDF5 file opened read-only whose objects are reached by hard links only (it cannot make
// kvsim open another file, nor loop through links). Every check throws InputError "<path>: ...".
class Hdf5Reader {
public:
    // Refuses a path that is not a regular file ("not an HDF5 file" when the signature is absent,
    // "cannot open as HDF5 (truncated or corrupt)" when HDF5 cannot open it).
    explicit Hdf5Reader(const std::string& path);

    const std::string& path() const { return path_; }
    hid_t file() const { return h5_.get(); }
    hid_t link_access() const { return lapl_.get(); }
    hid_t group_access() const { return gapl_.get(); }
    hid_t dataset_access() const { return dapl_.get(); }

    [[noreturn]] void fail(const std::string& what) const;

    // obj_name prefixes the messages ("" for the root, "/sequences/0: " for a group).
    Hdf5Handle open_attr(hid_t obj, const std::string& obj_name, const char* name) const;
    std::string string_attr(hid_t obj, const std::string& obj_name, const char* name) const;
    int64_t int_attr(hid_t obj, const std::string& obj_name, const char* name, int64_t min_value,
                     int64_t max_value = INT64_MAX, const char* why = "") const;
    // A one-dimensional floating-point attribute of exactly `size` elements, as doubles; `what`
    // says what the size is ("head_dim / 2").
    std::vector<double> double_array_attr(hid_t obj, const char* name, std::size_t size, const char* what) const;
    // A one-dimensional integer attribute of at most max_size elements, each within [lo, hi].
    std::vector<int64_t> int_array_attr(hid_t obj, const char* name, std::size_t max_size, int64_t lo, int64_t hi) const;

    bool has_link(const std::string& name) const;
    // Opens a dataset reached by a hard link and checks its element class and shape.
    Hdf5Handle open_dataset(const std::string& name, H5T_class_t element_class, const std::vector<hsize_t>& shape) const;
    // The data a dataset's shape implies must be in this file: HDF5 reads a chunk that was never
    // written, or contiguous storage never allocated, as zeros, so a few bytes of header can claim
    // a dataset of any size. External and virtual storage (other files) are refused too.
    void check_stored(const std::string& name, const Hdf5Handle& dataset, const std::vector<hsize_t>& shape) const;
    // The whole dataset into out, converted to mem_type.
    void read_all(const std::string& name, const Hdf5Handle& dataset, hid_t mem_type, void* out) const;

private:
    std::string path_;
    Hdf5Handle lapl_, gapl_, dapl_, h5_;
};

}  // namespace kvsim
