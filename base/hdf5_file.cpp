#include "base/hdf5_file.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "base/errors.h"
#include "base/input_file.h"
#include "base/size_limits.h"

namespace kvsim {
namespace {

struct SilenceHdf5 {
    SilenceHdf5() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }
};
const SilenceHdf5 silence_hdf5;  // the main thread's, at startup

constexpr size_t kMaxStringAttribute = 1 << 16;  // an object header holds at most 64 KiB

Hdf5Handle hard_links_only(hid_t list_class) {
    Hdf5Handle list = hdf5_plist(H5Pcreate(list_class));
    H5Pset_nlinks(list.get(), 0);
    return list;
}

}  // namespace

void silence_hdf5_here() {
    thread_local const SilenceHdf5 silenced;
    (void)silenced;
}

bool has_hdf5_signature(const std::string& path) {
    // HDF5's superblock signature, at offset 0 for every file kvsim writes (a user block would
    // move it to 512, 1024, ...: H5Fis_hdf5 looks there too).
    std::error_code error;
    if (!std::filesystem::is_regular_file(path, error)) return false;  // H5Fis_hdf5 would block on a FIFO
    silence_hdf5_here();
    std::ifstream in(path, std::ios::binary);
    char head[8] = {};
    if (!in.read(head, 8)) return false;
    if (std::memcmp(head, "\x89HDF\r\n\x1a\n", 8) == 0) return true;
    return H5Fis_hdf5(path.c_str()) > 0;
}

Hdf5Handle hdf5_group(hid_t id) { return Hdf5Handle(id, H5Gclose); }
Hdf5Handle hdf5_dataset(hid_t id) { return Hdf5Handle(id, H5Dclose); }
Hdf5Handle hdf5_space(hid_t id) { return Hdf5Handle(id, H5Sclose); }
Hdf5Handle hdf5_type(hid_t id) { return Hdf5Handle(id, H5Tclose); }
Hdf5Handle hdf5_attr(hid_t id) { return Hdf5Handle(id, H5Aclose); }
Hdf5Handle hdf5_plist(hid_t id) { return Hdf5Handle(id, H5Pclose); }

void write_string_attr(hid_t obj, const char* name, const std::string& value) {
    Hdf5Handle type = hdf5_type(H5Tcopy(H5T_C_S1));
    H5Tset_size(type.get(), std::max<size_t>(1, value.size()));
    H5Tset_strpad(type.get(), H5T_STR_NULLPAD);
    Hdf5Handle space = hdf5_space(H5Screate(H5S_SCALAR));
    Hdf5Handle attr = hdf5_attr(H5Acreate2(obj, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT));
    std::string padded = value.empty() ? std::string(1, '\0') : value;
    if (!attr.valid() || H5Awrite(attr.get(), type.get(), padded.data()) < 0)
        throw std::runtime_error(std::string("cannot write attribute ") + name);
}

void write_int_attr(hid_t obj, const char* name, int64_t value) {
    Hdf5Handle space = hdf5_space(H5Screate(H5S_SCALAR));
    Hdf5Handle attr = hdf5_attr(H5Acreate2(obj, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT));
    if (!attr.valid() || H5Awrite(attr.get(), H5T_NATIVE_INT64, &value) < 0)
        throw std::runtime_error(std::string("cannot write attribute ") + name);
}

void write_double_array_attr(hid_t obj, const char* name, const std::vector<double>& values) {
    const hsize_t n = values.size();
    Hdf5Handle space = hdf5_space(H5Screate_simple(1, &n, nullptr));
    Hdf5Handle attr = hdf5_attr(H5Acreate2(obj, name, H5T_IEEE_F64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT));
    if (!attr.valid() || H5Awrite(attr.get(), H5T_NATIVE_DOUBLE, values.data()) < 0)
        throw std::runtime_error(std::string("cannot write attribute ") + name);
}

void write_int_array_attr(hid_t obj, const char* name, const std::vector<int64_t>& values) {
    // An empty list is a dataspace of no points (HDF5 refuses a simple extent of size 0).
    const hsize_t n = values.size();
    Hdf5Handle space = hdf5_space(n == 0 ? H5Screate(H5S_NULL) : H5Screate_simple(1, &n, nullptr));
    Hdf5Handle attr = hdf5_attr(H5Acreate2(obj, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT));
    if (!attr.valid() || (n > 0 && H5Awrite(attr.get(), H5T_NATIVE_INT64, values.data()) < 0))
        throw std::runtime_error(std::string("cannot write attribute ") + name);
}

std::string show_shape(const std::vector<hsize_t>& d) {
    std::string s = "[";
    for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
    return s + "]";
}

Hdf5Reader::Hdf5Reader(const std::string& path)
    : path_(path), lapl_(hard_links_only(H5P_LINK_ACCESS)), gapl_(hard_links_only(H5P_GROUP_ACCESS)),
      dapl_(hard_links_only(H5P_DATASET_ACCESS)) {
    silence_hdf5_here();
    require_regular_file(path);  // a directory or FIFO: one line, never a hang inside HDF5
    if (H5Fis_hdf5(path.c_str()) <= 0) fail("not an HDF5 file");
    h5_ = Hdf5Handle(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    if (!h5_.valid()) fail("cannot open as HDF5 (truncated or corrupt)");
}

void Hdf5Reader::fail(const std::string& what) const { throw InputError(path_ + ": " + what); }

Hdf5Handle Hdf5Reader::open_attr(hid_t obj, const std::string& obj_name, const char* name) const {
    if (H5Aexists(obj, name) <= 0) fail(obj_name + "missing attribute '" + name + "'");
    Hdf5Handle attr = hdf5_attr(H5Aopen(obj, name, H5P_DEFAULT));
    if (!attr.valid()) fail(obj_name + "cannot read attribute '" + name + "'");
    return attr;
}

std::string Hdf5Reader::string_attr(hid_t obj, const std::string& obj_name, const char* name) const {
    Hdf5Handle attr = open_attr(obj, obj_name, name);
    Hdf5Handle type = hdf5_type(H5Aget_type(attr.get()));
    Hdf5Handle space = hdf5_space(H5Aget_space(attr.get()));
    if (H5Tget_class(type.get()) != H5T_STRING || H5Tis_variable_str(type.get()) > 0)
        fail(obj_name + "attribute '" + std::string(name) + "' is not a fixed-length string");
    // One string, of a size an attribute can hold: H5Aread writes every element of the
    // attribute's dataspace into the buffer, which holds one.
    const size_t size = H5Tget_size(type.get());
    if (H5Sget_simple_extent_npoints(space.get()) != 1 || size == 0 || size > kMaxStringAttribute)
        fail(obj_name + "attribute '" + std::string(name) + "' is not one string of at most " +
             std::to_string(kMaxStringAttribute) + " bytes");
    std::string value(size, '\0');
    if (H5Aread(attr.get(), type.get(), value.data()) < 0) fail(obj_name + "cannot read attribute '" + name + "'");
    value.resize(std::strlen(value.c_str()));
    return value;
}

int64_t Hdf5Reader::int_attr(hid_t obj, const std::string& obj_name, const char* name, int64_t min_value,
                             int64_t max_value, const char* why) const {
    Hdf5Handle attr = open_attr(obj, obj_name, name);
    Hdf5Handle type = hdf5_type(H5Aget_type(attr.get()));
    Hdf5Handle space = hdf5_space(H5Aget_space(attr.get()));
    if (H5Tget_class(type.get()) != H5T_INTEGER || H5Sget_simple_extent_npoints(space.get()) != 1)
        fail(obj_name + "attribute '" + std::string(name) + "' is not an integer");
    int64_t value = 0;
    if (H5Aread(attr.get(), H5T_NATIVE_INT64, &value) < 0) fail(obj_name + "cannot read attribute '" + name + "'");
    if (value < min_value)
        fail(obj_name + "attribute '" + name + "' = " + std::to_string(value) + " must be >= " +
             std::to_string(min_value));
    if (value > max_value)
        fail(obj_name + "attribute '" + name + "' = " + std::to_string(value) + " must be <= " +
             std::to_string(max_value) + why);
    return value;
}

std::vector<double> Hdf5Reader::double_array_attr(hid_t obj, const char* name, std::size_t size, const char* what) const {
    Hdf5Handle attr = open_attr(obj, "", name);
    Hdf5Handle type = hdf5_type(H5Aget_type(attr.get()));
    Hdf5Handle space = hdf5_space(H5Aget_space(attr.get()));
    const hssize_t points = H5Sget_simple_extent_npoints(space.get());
    if (H5Tget_class(type.get()) != H5T_FLOAT || H5Sget_simple_extent_ndims(space.get()) != 1 ||
        points != static_cast<hssize_t>(size))
        fail("root attribute '" + std::string(name) + "' must be " + std::to_string(size) +
             " floating-point numbers (" + what + ")");
    std::vector<double> values(size);
    if (H5Aread(attr.get(), H5T_NATIVE_DOUBLE, values.data()) < 0) fail(std::string("cannot read attribute '") + name + "'");
    return values;
}

std::vector<int64_t> Hdf5Reader::int_array_attr(hid_t obj, const char* name, std::size_t max_size, int64_t lo,
                                                int64_t hi) const {
    Hdf5Handle attr = open_attr(obj, "", name);
    Hdf5Handle type = hdf5_type(H5Aget_type(attr.get()));
    Hdf5Handle space = hdf5_space(H5Aget_space(attr.get()));
    const H5S_class_t space_class = H5Sget_simple_extent_type(space.get());
    if (H5Tget_class(type.get()) != H5T_INTEGER ||
        !(space_class == H5S_NULL || (space_class == H5S_SIMPLE && H5Sget_simple_extent_ndims(space.get()) == 1)))
        fail("root attribute '" + std::string(name) + "' must be a list of integers");
    const hssize_t points = space_class == H5S_NULL ? 0 : H5Sget_simple_extent_npoints(space.get());
    if (points < 0 || static_cast<std::size_t>(points) > max_size)
        fail("root attribute '" + std::string(name) + "' has more than " + std::to_string(max_size) + " integers");
    std::vector<int64_t> values(points);
    if (points > 0 && H5Aread(attr.get(), H5T_NATIVE_INT64, values.data()) < 0)
        fail(std::string("cannot read attribute '") + name + "'");
    for (std::size_t i = 0; i < values.size(); ++i)
        if (values[i] < lo || values[i] > hi)
            fail("root attribute '" + std::string(name) + "' element " + std::to_string(i) + " = " +
                 std::to_string(values[i]) + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return values;
}

bool Hdf5Reader::has_link(const std::string& name) const {
    return H5Lexists(h5_.get(), name.c_str(), lapl_.get()) > 0;
}

Hdf5Handle Hdf5Reader::open_dataset(const std::string& name, H5T_class_t element_class,
                                    const std::vector<hsize_t>& shape) const {
    if (H5Lexists(h5_.get(), name.c_str(), lapl_.get()) <= 0) fail("missing dataset '" + name + "'");
    H5L_info_t link{};
    if (H5Lget_info(h5_.get(), name.c_str(), &link, lapl_.get()) < 0 || link.type != H5L_TYPE_HARD)
        fail("'" + name + "' is a soft or external link; a kvsim file holds its datasets itself");
    if (H5Oexists_by_name(h5_.get(), name.c_str(), lapl_.get()) <= 0) fail("missing dataset '" + name + "'");
    Hdf5Handle dataset = hdf5_dataset(H5Dopen2(h5_.get(), name.c_str(), dapl_.get()));
    if (!dataset.valid()) fail("cannot open dataset '" + name + "'");
    Hdf5Handle type = hdf5_type(H5Dget_type(dataset.get()));
    if (H5Tget_class(type.get()) != element_class) fail("dataset '" + name + "' has the wrong element type");
    Hdf5Handle space = hdf5_space(H5Dget_space(dataset.get()));
    const int rank = H5Sget_simple_extent_ndims(space.get());
    std::vector<hsize_t> dims(std::max(rank, 0));
    if (rank > 0) H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
    if (dims != shape) fail("dataset '" + name + "' has shape " + show_shape(dims) + ", expected " + show_shape(shape));
    return dataset;
}

void Hdf5Reader::check_stored(const std::string& name, const Hdf5Handle& dataset, const std::vector<hsize_t>& shape) const {
    Hdf5Handle plist = hdf5_plist(H5Dget_create_plist(dataset.get()));
    Hdf5Handle type = hdf5_type(H5Dget_type(dataset.get()));
    if (!plist.valid() || !type.valid()) fail("cannot read the layout of dataset '" + name + "'");
    const std::string what = path_ + ": dataset '" + name + "' " + show_shape(shape);
    const uint64_t element_bytes = H5Tget_size(type.get());
    const uint64_t buffer_bytes = std::max<uint64_t>(element_bytes, sizeof(float));  // as read
    uint64_t elements = 1;
    for (hsize_t d : shape) elements = checked_mul(elements, d, what);
    const uint64_t raw = checked_mul(elements, element_bytes, what);
    const std::string claims = "dataset '" + name + "' " + show_shape(shape) + " (" + format_bytes(raw) + ")";
    if (H5Pget_external_count(plist.get()) != 0) fail(claims + " is stored in external files");
    switch (H5Pget_layout(plist.get())) {
        case H5D_COMPACT:
            return;  // in the object header itself
        case H5D_CONTIGUOUS: {
            const uint64_t stored = H5Dget_storage_size(dataset.get());
            if (stored < raw) fail(claims + " has " + format_bytes(stored) + " of storage allocated");
            return;
        }
        case H5D_CHUNKED: {
            const int rank = static_cast<int>(shape.size());
            std::vector<hsize_t> chunk(std::max(rank, 1));
            if (H5Pget_chunk(plist.get(), rank, chunk.data()) != rank)
                fail("cannot read the chunk shape of dataset '" + name + "'");
            uint64_t chunk_elements = 1, chunks = 1;
            for (int i = 0; i < rank; ++i) {
                if (chunk[i] == 0) fail("dataset '" + name + "' has an empty chunk shape");
                chunk_elements = checked_mul(chunk_elements, chunk[i], what);
                chunks = checked_mul(chunks, shape[i] / chunk[i] + (shape[i] % chunk[i] != 0), what);
            }
            // A reader inflates a whole chunk to read any part of it.
            check_memory(checked_mul(chunk_elements, buffer_bytes, what),
                         what + " in chunks of " + show_shape({chunk.begin(), chunk.end()}));
            hsize_t stored = 0;
            const Hdf5Handle space = hdf5_space(H5Dget_space(dataset.get()));  // 1.10 refuses H5S_ALL here
            if (H5Dget_num_chunks(dataset.get(), space.get(), &stored) < 0)
                fail("cannot read the chunk index of dataset '" + name + "'");
            if (stored < chunks)
                fail(claims + " stores " + std::to_string(stored) + " of its " + std::to_string(chunks) +
                     " chunks: the file does not hold the data its shape implies");
            return;
        }
        default:
            fail(claims + " has a layout kvsim does not read (virtual or unknown)");
    }
}

void Hdf5Reader::read_all(const std::string& name, const Hdf5Handle& dataset, hid_t mem_type, void* out) const {
    if (H5Dread(dataset.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) < 0)
        fail("cannot read dataset '" + name + "' (truncated or corrupt)");
}

}  // namespace kvsim
