#include "sim/trace_store.h"

#include <hdf5.h>
#include <libdeflate.h>
#include <tbb/parallel_for.h>
#include <zlib.h>

#include <Eigen/Core>  // Eigen::half: correctly rounded float -> float16
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#if defined(__F16C__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#include "kvsim_version.h"
#include "cache_math/numerics.h"
#include "base/atomic_file.h"
#include "base/errors.h"
#include "base/hdf5_file.h"
#include "base/input_file.h"
#include "base/size_limits.h"

namespace kvsim {
namespace {

using Handle = Hdf5Handle;
Handle group_handle(hid_t id) { return hdf5_group(id); }
Handle dataset_handle(hid_t id) { return hdf5_dataset(id); }
Handle space_handle(hid_t id) { return hdf5_space(id); }
Handle type_handle(hid_t id) { return hdf5_type(id); }
Handle plist_handle(hid_t id) { return hdf5_plist(id); }

// IEEE binary16 as an HDF5 type: sign bit 15, exponent bits 10..14 (bias 15), mantissa 0..9.
Handle float16_type() {
    Handle t = type_handle(H5Tcopy(H5T_IEEE_F32LE));
    H5Tset_fields(t.get(), 15, 10, 5, 0, 10);
    H5Tset_size(t.get(), 2);
    H5Tset_ebias(t.get(), 15);
    return t;
}

// Halves (IEEE binary16 bits) to floats. Every half is exactly a float, so F16C's conversion and
// cache_math.h's portable one (the fallback) give the same bits as HDF5's soft-float conversion.
void halves_to_floats(const uint16_t* in, float* out, std::size_t n) {
    std::size_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
#endif
    for (; i < n; ++i) out[i] = half_bits_to_float(in[i]);
}

// `count` halves stored as bytes (any alignment; they may lie in `out` itself, from byte 2 count
// on) widened into out[0, count) through a small copy: floats [0, i) end at byte 4 i, never past
// byte 2 count + 2 i, where the halves not yet widened begin.
void widen_stored_halves(const unsigned char* halves, std::size_t count, float* out) {
    constexpr std::size_t kChunk = 4096;
    uint16_t chunk[kChunk];
    for (std::size_t first = 0; first < count; first += kChunk) {
        const std::size_t n = std::min(kChunk, count - first);
        std::memcpy(chunk, halves + 2 * first, 2 * n);
        halves_to_floats(chunk, out + first, n);
    }
}

// NaN and +-Inf: every exponent bit set.
inline uint32_t non_finite_bits(uint32_t bits) { return (bits & 0x7f800000u) == 0x7f800000u; }

// Reads all `count` elements of `dataset` into `out` as floats; false where HDF5 fails. IEEE
// half data is read as its own bits and converted here: HDF5's fp16 -> fp32 conversion works bit
// by bit in software and took 43% of a replay of an fp16 trace. Other float types go through
// HDF5's conversion, as before.
bool read_as_floats(hid_t dataset, std::size_t count, float* out) {
    const Handle file_type = type_handle(H5Dget_type(dataset));
    const Handle half = float16_type();
    if (!file_type.valid() || H5Tequal(file_type.get(), half.get()) <= 0)
        return H5Dread(dataset, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) >= 0;
    // The halves land in the upper half of `out` (bytes 2 count on), no second buffer, and are
    // widened front to back (widen_stored_halves).
    unsigned char* bytes = reinterpret_cast<unsigned char*>(out);
    unsigned char* halves = bytes + 2 * count;
    if (H5Dread(dataset, half.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, halves) < 0) return false;
    widen_stored_halves(halves, count, out);
    return true;
}

// Reads a Q/K/V dataset of `tokens` rows of `row_elements` into `out` as floats from its stored
// chunks, where it is laid out as kvsim writes it: chunks of whole token rows, IEEE half or float
// (little-endian), shuffled then deflated (either, both or neither). Each chunk's stored bytes are
// inflated by libdeflate, and unshuffled and widened in one pass: HDF5's pipeline (zlib's inflate,
// its unshuffle, then a copy out of its chunk buffer) read the llama-1b-4096 trace's 16 layers in
// 2.68 s of CPU, this in about half. Lossless either way: the same floats. Returns false, having
// decided nothing, where the dataset is laid out or filtered otherwise or a chunk is not exactly
// what its filters make (missing, skipped filters, not inflating to its size): the caller then
// reads through HDF5, which reads it or reports it as it always has. `checked_finite` tells
// whether every value was also found finite on the way (shuffled chunks, as kvsim writes them):
// the caller's own pass over the layer then has nothing to find.
bool read_stored_chunks(hid_t dataset, hsize_t tokens, hsize_t row_elements, float* out, bool& checked_finite) {
    checked_finite = false;
    const Handle plist = plist_handle(H5Dget_create_plist(dataset));
    const Handle file_type = type_handle(H5Dget_type(dataset));
    if (!plist.valid() || !file_type.valid() || H5Pget_layout(plist.get()) != H5D_CHUNKED) return false;
    hsize_t chunk[3];
    // Chunks of whole token rows, no more of them than the dataset has (the reader checked at open
    // that a chunk of this shape fits in memory).
    if (H5Pget_chunk(plist.get(), 3, chunk) != 3 || chunk[0] == 0 || chunk[0] > std::max<hsize_t>(tokens, 1) ||
        chunk[1] == 0 || chunk[2] == 0 || chunk[1] > row_elements || chunk[1] * chunk[2] != row_elements)
        return false;
    const Handle half = float16_type();
    std::size_t element_bytes;
    if (H5Tequal(file_type.get(), half.get()) > 0)
        element_bytes = 2;
    else if (H5Tequal(file_type.get(), H5T_IEEE_F32LE) > 0)
        element_bytes = 4;
    else
        return false;
    bool shuffled = false, deflated = false;
    const int filters = H5Pget_nfilters(plist.get());
    if (filters < 0 || filters > 2) return false;
    for (int i = 0; i < filters; ++i) {
        unsigned flags = 0, config = 0, values[4] = {};
        std::size_t count = 4;
        const H5Z_filter_t filter = H5Pget_filter2(plist.get(), i, &flags, &count, values, 0, nullptr, &config);
        if (filter == H5Z_FILTER_SHUFFLE && i == 0 && count >= 1 && values[0] == element_bytes)
            shuffled = true;
        else if (filter == H5Z_FILTER_DEFLATE && !deflated)
            deflated = true;
        else
            return false;
    }
    const std::size_t chunk_elements = chunk[0] * row_elements, chunk_bytes = chunk_elements * element_bytes;
    // Deflate's stored blocks add 5 bytes per 64 KiB: a larger chunk is not one deflate made.
    const std::size_t most_stored = deflated ? chunk_bytes + chunk_bytes / 1024 + 1024 : chunk_bytes;
    std::unique_ptr<libdeflate_decompressor, void (*)(libdeflate_decompressor*)> inflater(
        libdeflate_alloc_decompressor(), libdeflate_free_decompressor);
    if (!inflater) return false;
    std::vector<unsigned char> stored, planes(deflated ? chunk_bytes : 0);
    // Non-zero once a value is NaN or +-Inf (an exponent of all ones), where the loops check.
    uint32_t not_finite = 0;
    bool every_value_checked = shuffled;
    for (hsize_t first = 0; first < tokens; first += chunk[0]) {
        const hsize_t offset[3] = {first, 0, 0};
        hsize_t size = 0;
        uint32_t skipped = 0;
        if (H5Dget_chunk_storage_size(dataset, offset, &size) < 0 || size == 0 || size > most_stored) return false;
        stored.resize(size);
        if (H5Dread_chunk(dataset, H5P_DEFAULT, offset, &skipped, stored.data()) < 0 || skipped != 0) return false;
        if (deflated) {
            std::size_t used = 0, made = 0;
            if (libdeflate_zlib_decompress_ex(inflater.get(), stored.data(), stored.size(), planes.data(), chunk_bytes,
                                              &used, &made) != LIBDEFLATE_SUCCESS ||
                made != chunk_bytes)
                return false;
        } else if (size != chunk_bytes) {
            return false;
        }
        // The chunk's rows that the dataset holds (an edge chunk is stored whole).
        const std::size_t n = std::min<hsize_t>(chunk[0], tokens - first) * row_elements;
        float* to = out + first * row_elements;
        const unsigned char* from = deflated ? planes.data() : stored.data();
        if (!shuffled) {
            if (element_bytes == 4)
                std::memcpy(to, from, 4 * n);
            else
                widen_stored_halves(from, n, to);
        } else if (element_bytes == 2) {
            // Plane 0 holds every half's low byte, plane 1 its high byte.
            const unsigned char *low = from, *high = from + chunk_elements;
            std::size_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
            for (; i + 32 <= n; i += 32) {
                const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + i));
                const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + i));
                // Bytes interleave within 128-bit lanes: halves 0-7 and 16-23, then 8-15 and 24-31.
                const __m256i a = _mm256_unpacklo_epi8(l, h), b = _mm256_unpackhi_epi8(l, h);
                const __m512 first = _mm512_cvtph_ps(_mm256_permute2x128_si256(a, b, 0x20));
                const __m512 second = _mm512_cvtph_ps(_mm256_permute2x128_si256(a, b, 0x31));
                _mm512_storeu_ps(to + i, first);
                _mm512_storeu_ps(to + i + 16, second);
#if defined(__AVX512DQ__)
                constexpr int kNanOrInf = 0x01 | 0x08 | 0x10 | 0x80;  // quiet NaN, +Inf, -Inf, signalling NaN
                not_finite |= _mm512_fpclass_ps_mask(first, kNanOrInf) | _mm512_fpclass_ps_mask(second, kNanOrInf);
#else
                every_value_checked = false;
#endif
            }
#endif
            for (; i < n; ++i) {
                const uint16_t bits = static_cast<uint16_t>(low[i] | high[i] << 8);
                to[i] = half_bits_to_float(bits);
                not_finite |= (bits & 0x7c00u) == 0x7c00u;
            }
        } else {
            const unsigned char* plane[4] = {from, from + chunk_elements, from + 2 * chunk_elements,
                                             from + 3 * chunk_elements};
            std::size_t i = 0;
#if defined(__SSE2__)
            // Sixteen floats at a time: bytes 0 and 1, and 2 and 3, paired, then the pairs paired.
            const __m128i exponent = _mm_set1_epi32(0x7f800000);
            __m128i all_ones_exponent = _mm_setzero_si128();
            for (; i + 16 <= n; i += 16) {
                const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(plane[0] + i));
                const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(plane[1] + i));
                const __m128i b2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(plane[2] + i));
                const __m128i b3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(plane[3] + i));
                const __m128i low_first = _mm_unpacklo_epi8(b0, b1), low_second = _mm_unpackhi_epi8(b0, b1);
                const __m128i high_first = _mm_unpacklo_epi8(b2, b3), high_second = _mm_unpackhi_epi8(b2, b3);
                const __m128i words[4] = {_mm_unpacklo_epi16(low_first, high_first), _mm_unpackhi_epi16(low_first, high_first),
                                          _mm_unpacklo_epi16(low_second, high_second),
                                          _mm_unpackhi_epi16(low_second, high_second)};
                for (int w = 0; w < 4; ++w) {
                    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i + 4 * w), words[w]);
                    all_ones_exponent = _mm_or_si128(
                        all_ones_exponent, _mm_cmpeq_epi32(_mm_and_si128(words[w], exponent), exponent));
                }
            }
            not_finite |= _mm_movemask_epi8(all_ones_exponent) != 0;
#endif
            for (; i < n; ++i) {
                const uint32_t bits = static_cast<uint32_t>(plane[0][i]) | static_cast<uint32_t>(plane[1][i]) << 8 |
                                      static_cast<uint32_t>(plane[2][i]) << 16 | static_cast<uint32_t>(plane[3][i]) << 24;
                std::memcpy(to + i, &bits, 4);
                not_finite |= non_finite_bits(bits);
            }
        }
    }
    checked_finite = every_value_checked && not_finite == 0;
    return true;
}

std::string sequence_group(int sequence) {
    char name[32];
    std::snprintf(name, sizeof name, "/sequences/%06d", sequence);
    return name;
}
std::string layer_name(int layer) {
    char name[32];
    std::snprintf(name, sizeof name, "layer_%03d", layer);
    return name;
}
std::string head_name(int head) {
    char name[32];
    std::snprintf(name, sizeof name, "head_%03d", head);
    return name;
}
std::string attention_path(int sequence, int layer, int head) {
    return sequence_group(sequence) + "/attention/" + layer_name(layer) + "/" + head_name(head);
}
std::string qkv_path(int sequence, int layer, const char* tensor) {
    return sequence_group(sequence) + "/qkv/" + layer_name(layer) + "/" + tensor;
}

// Creates every missing group along `path` (like mkdir -p).
Handle ensure_group(hid_t file, const std::string& path) {
    std::string partial;
    Handle group;
    size_t start = 1;
    while (start <= path.size()) {
        size_t slash = path.find('/', start);
        if (slash == std::string::npos) slash = path.size();
        partial = path.substr(0, slash);
        if (H5Lexists(file, partial.c_str(), H5P_DEFAULT) > 0)
            group = group_handle(H5Gopen2(file, partial.c_str(), H5P_DEFAULT));
        else
            group = group_handle(H5Gcreate2(file, partial.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
        if (!group.valid()) throw std::runtime_error("cannot create group " + partial);
        start = slash + 1;
    }
    return group;
}

// Deflate's level in the filter pipeline of every dataset kvsim writes (HDF5 compresses attention
// rows at it; Q/K/V chunks are deflated by deflate_chunk below, Huffman codes only).
constexpr int kDeflateLevel = 4;

// Chunked, shuffled, deflated: attention rows and Q/K/V compress well and stream in blocks.
Handle compressed_layout(int rank, const hsize_t* chunk) {
    Handle plist = plist_handle(H5Pcreate(H5P_DATASET_CREATE));
    H5Pset_chunk(plist.get(), rank, chunk);
    H5Pset_shuffle(plist.get());
    H5Pset_deflate(plist.get(), kDeflateLevel);
    return plist;
}

// Writes rows [first_row, first_row + rows) of a 3-d dataset laid out by compressed_layout
// (chunks of `chunk_rows` along the first axis; first_row a multiple of it, and the rows whole
// chunks or the dataset's last) whose elements are `element_bytes` wide. HDF5 filters the chunks of one H5Dwrite
// one after another on one core; here each chunk is shuffled and deflated exactly as its filter
// pipeline would (byte planes, then a zlib stream), on every core, and handed to HDF5 as stored
// bytes. Readers see an ordinary filtered dataset; the bytes do not depend on the thread count.
// One chunk as a zlib stream (what HDF5's deflate filter stores), Huffman codes only: in Q/K/V's
// byte planes the repeats LZ77 looks for are rare (the exponent plane is skewed, not repetitive).
// On the llama-1b-4096 synthetic trace (fp16) this stores 681 MB where level 4 stored 691 MB,
// and trace synth's CPU time went from 44 s to 22 s with it and the parallel chunks.
bool deflate_chunk(std::vector<unsigned char>& in, std::vector<unsigned char>& out) {
    z_stream z{};
    if (deflateInit2(&z, kDeflateLevel, Z_DEFLATED, 15, 8, Z_HUFFMAN_ONLY) != Z_OK) return false;
    out.resize(deflateBound(&z, static_cast<uLong>(in.size())));
    z.next_in = in.data();
    z.avail_in = static_cast<uInt>(in.size());
    z.next_out = out.data();
    z.avail_out = static_cast<uInt>(out.size());
    const bool done = deflate(&z, Z_FINISH) == Z_STREAM_END;
    out.resize(z.total_out);
    deflateEnd(&z);
    return done;
}

static_assert(std::endian::native == std::endian::little, "the chunks are written as this machine's bytes");
bool write_chunks_in_parallel(hid_t dataset, const void* data, hsize_t first_row, hsize_t rows, const hsize_t dims[3],
                              hsize_t chunk_rows, std::size_t element_bytes) {
    const std::size_t row_elements = dims[1] * dims[2], chunk_elements = chunk_rows * row_elements;
    const std::size_t chunk_bytes = chunk_elements * element_bytes;
    const hsize_t first_chunk = first_row / chunk_rows, chunks = (rows + chunk_rows - 1) / chunk_rows;
    std::vector<std::vector<unsigned char>> stored(chunks);
    std::vector<int> failed(chunks, 0);
    const auto* bytes = static_cast<const unsigned char*>(data);
    tbb::parallel_for(hsize_t{0}, chunks, [&](hsize_t c) {
        // An edge chunk is stored whole, its missing rows zero (HDF5's own fill for them).
        const std::size_t present = std::min<hsize_t>(chunk_rows, rows - c * chunk_rows) * row_elements;
        const unsigned char* in = bytes + c * chunk_bytes;
        std::vector<unsigned char> planes(chunk_bytes, 0);
        for (std::size_t b = 0; b < element_bytes; ++b) {
            unsigned char* plane = planes.data() + b * chunk_elements;
            for (std::size_t i = 0; i < present; ++i) plane[i] = in[i * element_bytes + b];
        }
        failed[c] = !deflate_chunk(planes, stored[c]);
    });
    for (hsize_t c = 0; c < chunks; ++c) {
        const hsize_t offset[3] = {(first_chunk + c) * chunk_rows, 0, 0};
        if (failed[c] || H5Dwrite_chunk(dataset, H5P_DEFAULT, 0, offset, stored[c].size(), stored[c].data()) < 0)
            return false;
    }
    return true;
}

constexpr hsize_t kAttentionChunk = 1 << 16;  // floats: 256 KiB

// A row of attention may sum to this much over 1 (its own weight, not stored, makes up the rest):
// float rounding of a softmax, float16 storage included, stays far below it.
constexpr double kRowSumTolerance = 1e-3;

// The first element in [data, data + n) whose bit pattern `bad` flags, or n. Blocks of 256 are
// OR-reduced with a branch-free loop the compiler vectorises; only a block that fails is searched
// element by element, so a valid trace pays one pass of integer compares.
template <class Bad>
std::size_t first_flagged(const float* data, std::size_t n, Bad bad) {
    constexpr std::size_t kBlock = 256;
    std::size_t i = 0;
    for (; i + kBlock <= n; i += kBlock) {
        uint32_t any = 0;
        for (std::size_t l = 0; l < kBlock; ++l) {
            uint32_t bits;
            std::memcpy(&bits, data + i + l, 4);
            any |= bad(bits);
        }
        if (any) break;
    }
    for (; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, data + i, 4);
        if (bad(bits)) return i;
    }
    return n;
}

// Not an attention weight: anything above 1.0f as an unsigned pattern is > 1, +Inf, NaN or
// negative, except -0, which is 0.
inline uint32_t not_weight_bits(uint32_t bits) { return (bits > 0x3f800000u) & (bits != 0x80000000u); }

// Sum of a row in double with 8 independent lanes (vectorised; a float sum of 2^30 weights could
// drift past the tolerance).
double row_sum(const float* row, int64_t n) {
    double lane[8] = {};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; ++l) lane[l] += row[j + l];
    double sum = 0;
    for (; j < n; ++j) sum += row[j];
    for (double v : lane) sum += v;
    return sum;
}

std::string format_float(double x) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", x);
    return text;
}

}  // namespace

const char* to_string(TraceKind kind) { return kind == TraceKind::attention ? "attention" : "qkv"; }

int64_t attention_floats(int64_t length, const std::string& what) {
    if (length < 0 || length > kMaxTraceTokens)
        throw InputError(what + ": " + std::to_string(length) + " tokens is outside [0, " +
                         std::to_string(kMaxTraceTokens) + "]");
    return attention_row_offset(length);
}

// ---------------------------------------------------------------------------------------------
// Writer

struct TraceWriter::Impl {
    AtomicFile file;
    TraceMetadata metadata;
    Handle h5;
    std::vector<SequenceInfo> sequences;
    explicit Impl(const std::string& path) : file(path) {}
};

TraceWriter::TraceWriter(const std::string& path, TraceMetadata metadata) : impl_(std::make_unique<Impl>(path)) {
    metadata.kvsim_version = KVSIM_VERSION;
    impl_->metadata = metadata;
    impl_->h5 = Handle(H5Fcreate(impl_->file.temp_path().c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    if (!impl_->h5.valid()) throw InputError(path + ": cannot create HDF5 file");
    const hid_t root = impl_->h5.get();
    write_string_attr(root, "format", kTraceFormat);
    write_int_attr(root, "format_version", kTraceFormatVersion);
    write_string_attr(root, "kind", to_string(metadata.kind));
    write_string_attr(root, "model_name", metadata.model_name);
    write_int_attr(root, "num_layers", metadata.num_layers);
    write_int_attr(root, "num_query_heads", metadata.num_query_heads);
    write_int_attr(root, "num_kv_heads", metadata.num_kv_heads);
    write_int_attr(root, "head_dim", metadata.head_dim);
    write_string_attr(root, "source_kind", metadata.source_kind);
    write_string_attr(root, "source_generator", metadata.source_generator);
    write_int_attr(root, "source_seed", metadata.source_seed);
    write_string_attr(root, "source_model_file", metadata.source_model_file);
    write_string_attr(root, "source_model_sha256", metadata.source_model_sha256);
    write_string_attr(root, "source_text_sha256", metadata.source_text_sha256);
    if (!metadata.source_text_normalization.empty())
        write_string_attr(root, "source_text_normalization", metadata.source_text_normalization);
    if (metadata.source_sliding_window > 0) write_int_attr(root, "source_sliding_window", metadata.source_sliding_window);
    if (!metadata.source_layers.empty()) write_string_attr(root, "source_layers", metadata.source_layers);
    if (metadata.rope.known()) {
        write_string_attr(root, "rope_pairing", to_string(metadata.rope.pairing));
        write_double_array_attr(root, "rope_frequencies", metadata.rope.frequencies);
    }
    if (metadata.pre_rope_keys) write_int_attr(root, "pre_rope_keys", 1);
    write_string_attr(root, "kvsim_version", metadata.kvsim_version);
    ensure_group(root, "/sequences");
}

TraceWriter::~TraceWriter() = default;

int TraceWriter::add_sequence(const std::string& name, int64_t length) {
    const int index = static_cast<int>(impl_->sequences.size());
    Handle group = ensure_group(impl_->h5.get(), sequence_group(index));
    write_string_attr(group.get(), "name", name);
    write_int_attr(group.get(), "length", length);
    impl_->sequences.push_back({name, length});
    return index;
}

void TraceWriter::write_attention_rows(int sequence, int layer, int head, int64_t first_step,
                                       std::span<const float> rows) {
    const hid_t file = impl_->h5.get();
    const int64_t length = impl_->sequences.at(sequence).length;
    const std::string path = attention_path(sequence, layer, head);
    Handle dataset;
    if (H5Lexists(file, sequence_group(sequence).c_str(), H5P_DEFAULT) > 0 &&
        H5Lexists(file, (sequence_group(sequence) + "/attention").c_str(), H5P_DEFAULT) > 0 &&
        H5Lexists(file, (sequence_group(sequence) + "/attention/" + layer_name(layer)).c_str(), H5P_DEFAULT) > 0 &&
        H5Lexists(file, path.c_str(), H5P_DEFAULT) > 0) {
        dataset = dataset_handle(H5Dopen2(file, path.c_str(), H5P_DEFAULT));
    } else {
        Handle group = ensure_group(file, sequence_group(sequence) + "/attention/" + layer_name(layer));
        const hsize_t total = static_cast<hsize_t>(attention_row_offset(length));
        const hsize_t chunk = std::max<hsize_t>(1, std::min(total, kAttentionChunk));
        Handle space = space_handle(H5Screate_simple(1, &total, nullptr));
        Handle layout = compressed_layout(1, &chunk);
        dataset = dataset_handle(H5Dcreate2(group.get(), head_name(head).c_str(), H5T_IEEE_F32LE, space.get(),
                                            H5P_DEFAULT, layout.get(), H5P_DEFAULT));
    }
    if (!dataset.valid()) throw std::runtime_error("cannot create dataset " + path);
    const hsize_t offset = static_cast<hsize_t>(attention_row_offset(first_step));
    const hsize_t count = rows.size();
    Handle file_space = space_handle(H5Dget_space(dataset.get()));
    H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, &offset, nullptr, &count, nullptr);
    Handle mem_space = space_handle(H5Screate_simple(1, &count, nullptr));
    if (H5Dwrite(dataset.get(), H5T_NATIVE_FLOAT, mem_space.get(), file_space.get(), H5P_DEFAULT, rows.data()) < 0)
        throw std::runtime_error("cannot write dataset " + path);
}

void TraceWriter::write_qkv(int sequence, int layer, const QkvLayer& data, TensorDtype dtype) {
    write_qkv_rows(sequence, layer, 0, data, dtype);
}

void TraceWriter::write_qkv_rows(int sequence, int layer, int64_t first_token, const QkvLayer& rows, TensorDtype dtype) {
    const TraceMetadata& m = impl_->metadata;
    const int64_t length = impl_->sequences.at(static_cast<std::size_t>(sequence)).length;
    if (first_token < 0 || rows.tokens < 0 || first_token + rows.tokens > length)
        throw std::logic_error("write_qkv_rows: tokens outside the sequence");
    const std::string group_name = sequence_group(sequence) + "/qkv/" + layer_name(layer);
    Handle group = ensure_group(impl_->h5.get(), group_name);
    Handle half = float16_type();
    const hid_t file_type = dtype == TensorDtype::float16 ? half.get() : H5T_IEEE_F32LE;
    auto write = [&](const char* name, const std::vector<float>& values, int64_t heads) {
        // The dataset spans the whole sequence, chunked by 256 tokens and compressed; it is made by
        // the first write and each call fills its rows.
        const hsize_t dims[3] = {static_cast<hsize_t>(length), static_cast<hsize_t>(heads),
                                 static_cast<hsize_t>(m.head_dim)};
        const hsize_t per_token = dims[1] * dims[2];
        if (values.size() != static_cast<std::size_t>(rows.tokens) * per_token)
            throw std::logic_error(std::string("write_qkv_rows: ") + name + " has the wrong size");
        const hsize_t chunk_rows = std::max<hsize_t>(1, std::min<hsize_t>(dims[0], 256));
        Handle dataset;
        if (H5Lexists(group.get(), name, H5P_DEFAULT) > 0) {
            dataset = dataset_handle(H5Dopen2(group.get(), name, H5P_DEFAULT));
        } else {
            const hsize_t chunk[3] = {chunk_rows, dims[1], dims[2]};
            Handle space = space_handle(H5Screate_simple(3, dims, nullptr));
            Handle layout = compressed_layout(3, chunk);
            dataset = dataset_handle(
                H5Dcreate2(group.get(), name, file_type, space.get(), H5P_DEFAULT, layout.get(), H5P_DEFAULT));
        }
        if (!dataset.valid()) throw std::runtime_error(std::string("cannot write dataset ") + name);
        if (rows.tokens == 0) return;
        const hsize_t start[3] = {static_cast<hsize_t>(first_token), 0, 0};
        const hsize_t count[3] = {static_cast<hsize_t>(rows.tokens), dims[1], dims[2]};
        Handle file_space = space_handle(H5Dget_space(dataset.get()));
        Handle memory_space = space_handle(H5Screate_simple(3, count, nullptr));
        if (H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start, nullptr, count, nullptr) < 0)
            throw std::runtime_error(std::string("cannot select rows of dataset ") + name);
        // Rows that fill whole chunks (or end the sequence) are deflated on every core and stored
        // as chunks; any other run of rows goes through HDF5's own filters.
        const bool whole_chunks = static_cast<hsize_t>(first_token) % chunk_rows == 0 &&
                                  (static_cast<hsize_t>(rows.tokens) % chunk_rows == 0 || first_token + rows.tokens == length);
        auto write_chunks = [&](const void* data, std::size_t element_bytes) -> herr_t {
            return write_chunks_in_parallel(dataset.get(), data, static_cast<hsize_t>(first_token),
                                            static_cast<hsize_t>(rows.tokens), dims, chunk_rows, element_bytes)
                       ? 0
                       : -1;
        };
        herr_t status;
        if (dtype == TensorDtype::float16) {
            // Round to nearest even ourselves and hand HDF5 the bits, so no conversion path is in doubt.
            std::vector<Eigen::half> halves(values.begin(), values.end());
            // A finite value past float16's range (65504) would be stored as Inf, which no reader
            // accepts: refuse it here, where the user can still choose float32.
            for (std::size_t i = 0; i < halves.size(); ++i)
                if (!Eigen::numext::isfinite(halves[i]) && std::isfinite(values[i])) {
                    throw InputError(impl_->file.path() + ": " + name + " of " + sequence_group(sequence) + " layer " +
                                     std::to_string(layer) + " holds " + std::to_string(values[i]) + " (token " +
                                     std::to_string(first_token + static_cast<int64_t>(i / per_token)) + ", head " +
                                     std::to_string(i % per_token / dims[2]) + ", channel " +
                                     std::to_string(i % dims[2]) + "), beyond float16's range of +-65504; store float32 instead");
                }
            status = whole_chunks ? write_chunks(halves.data(), 2)
                                  : H5Dwrite(dataset.get(), half.get(), memory_space.get(), file_space.get(),
                                             H5P_DEFAULT, halves.data());
        } else {
            status = whole_chunks ? write_chunks(values.data(), 4)
                                  : H5Dwrite(dataset.get(), H5T_NATIVE_FLOAT, memory_space.get(), file_space.get(),
                                             H5P_DEFAULT, values.data());
        }
        if (status < 0) throw std::runtime_error(std::string("cannot write dataset ") + name);
    };
    write("q", rows.q, m.num_query_heads);
    write("k", rows.k, m.num_kv_heads);
    write("v", rows.v, m.num_kv_heads);
    if (m.pre_rope_keys)
        write("k_pre_rope", rows.k_pre_rope, m.num_kv_heads);
    else if (!rows.k_pre_rope.empty())
        throw std::logic_error("write_qkv_rows: keys before RoPE for a trace that does not record them");
}

void TraceWriter::write_tokens(int sequence, std::span<const int32_t> tokens) {
    Handle group = ensure_group(impl_->h5.get(), sequence_group(sequence));
    const hsize_t n = tokens.size();
    Handle space = space_handle(H5Screate_simple(1, &n, nullptr));
    Handle dataset = dataset_handle(
        H5Dcreate2(group.get(), "tokens", H5T_STD_I32LE, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    if (!dataset.valid() || H5Dwrite(dataset.get(), H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, tokens.data()) < 0)
        throw std::runtime_error("cannot write tokens");
}

void TraceWriter::commit() {
    write_int_attr(impl_->h5.get(), "num_sequences", static_cast<int64_t>(impl_->sequences.size()));
    impl_->h5.reset();
    impl_->file.commit();
}

// ---------------------------------------------------------------------------------------------
// Reader

struct TraceReader::Impl : Hdf5Reader {
    TraceMetadata metadata;
    std::vector<SequenceInfo> sequences;
    // Q/K/V datasets read_stored_chunks served (a layer loads beside the replay: atomic).
    mutable std::atomic<uint64_t> from_chunks{0};

    explicit Impl(const std::string& path) : Hdf5Reader(path) {}

    // One layer's Q, K, V or pre-RoPE K ([tokens][heads][head_dim]) into out, every value checked.
    void read_tensor(int sequence, int layer, const char* tensor, std::vector<float>& out, int64_t heads) const {
        silence_hdf5_here();
        const hsize_t t = static_cast<hsize_t>(sequences.at(sequence).length), d = static_cast<hsize_t>(metadata.head_dim);
        const std::string name = qkv_path(sequence, layer, tensor);
        Handle dataset = open_dataset(name, H5T_FLOAT, {t, static_cast<hsize_t>(heads), d});
        // Every element is overwritten; a buffer too small is freed first, so that growing it
        // never holds the old and the new one at once.
        if (out.capacity() < t * heads * d) out = std::vector<float>();
        out.resize(t * heads * d);
        bool checked_finite = false;
        if (read_stored_chunks(dataset.get(), t, heads * d, out.data(), checked_finite))
            ++from_chunks;
        else if (!read_as_floats(dataset.get(), out.size(), out.data()))
            fail("cannot read dataset '" + name + "' (truncated or corrupt)");
        // Checked as the layer is read: one NaN or Inf would reach the softmax and the selection.
        // Where the chunks' reading found none, there is nothing to look for.
        const std::size_t bad = checked_finite ? out.size() : first_flagged(out.data(), out.size(), non_finite_bits);
        if (bad < out.size()) {
            const uint64_t per_token = static_cast<uint64_t>(heads) * d;
            fail("dataset '" + name + "': element " + std::to_string(bad) + " (token " + std::to_string(bad / per_token) +
                 ", head " + std::to_string(bad % per_token / d) + ", channel " + std::to_string(bad % d) + ") is " +
                 format_float(out[bad]) + "; Q, K and V must be finite");
        }
    }
};

TraceReader::TraceReader(const std::string& path) : impl_(std::make_unique<Impl>(path)) {
    Impl& r = *impl_;
    const hid_t root = r.file();
    if (H5Aexists(root, "format") <= 0) r.fail("not a kvsim trace (no root attribute 'format')");
    const std::string format = r.string_attr(root, "", "format");
    if (format != kTraceFormat) r.fail("not a kvsim trace (root attribute 'format' is '" + format + "')");
    const int64_t version = r.int_attr(root, "", "format_version", 0);
    if (version != kTraceFormatVersion)
        r.fail("root attribute 'format_version' is " + std::to_string(version) + "; this kvsim reads version " +
               std::to_string(kTraceFormatVersion));

    TraceMetadata& m = r.metadata;
    const std::string kind = r.string_attr(root, "", "kind");
    if (kind == "attention")
        m.kind = TraceKind::attention;
    else if (kind == "qkv")
        m.kind = TraceKind::qkv;
    else
        r.fail("root attribute 'kind' is '" + kind + "' (expected attention or qkv)");
    m.model_name = r.string_attr(root, "", "model_name");
    // Counts and sizes are int64 in the file and int in the replay: range-checked here, once.
    constexpr int64_t kInt = INT32_MAX;
    m.num_layers = r.int_attr(root, "", "num_layers", 1, kInt);
    m.num_query_heads = r.int_attr(root, "", "num_query_heads", 1, kInt);
    m.num_kv_heads = r.int_attr(root, "", "num_kv_heads", 1, kInt);
    m.head_dim = r.int_attr(root, "", "head_dim", m.kind == TraceKind::qkv ? 1 : 0, kInt);
    if (m.num_query_heads % m.num_kv_heads != 0)
        r.fail("root attributes: num_query_heads " + std::to_string(m.num_query_heads) +
               " is not a multiple of num_kv_heads " + std::to_string(m.num_kv_heads));
    m.source_kind = r.string_attr(root, "", "source_kind");
    m.source_generator = r.string_attr(root, "", "source_generator");
    m.source_seed = r.int_attr(root, "", "source_seed", INT64_MIN);
    m.source_model_file = r.string_attr(root, "", "source_model_file");
    m.source_model_sha256 = r.string_attr(root, "", "source_model_sha256");
    m.source_text_sha256 = r.string_attr(root, "", "source_text_sha256");
    if (H5Aexists(root, "source_text_normalization") > 0) {  // optional: only captures that normalised
        m.source_text_normalization = r.string_attr(root, "", "source_text_normalization");
        if (m.source_text_normalization != "nfc")
            r.fail("root attribute 'source_text_normalization' is '" + m.source_text_normalization + "' (expected nfc)");
    }
    if (H5Aexists(root, "source_sliding_window") > 0)  // optional: only models with a window
        m.source_sliding_window = r.int_attr(root, "", "source_sliding_window", 1, kInt);
    if (H5Aexists(root, "source_layers") > 0) m.source_layers = r.string_attr(root, "", "source_layers");
    // Optional: the RoPE a capture recorded, both attributes or neither.
    const bool has_pairing = H5Aexists(root, "rope_pairing") > 0, has_frequencies = H5Aexists(root, "rope_frequencies") > 0;
    if (has_pairing != has_frequencies)
        r.fail(std::string("root attribute '") + (has_pairing ? "rope_frequencies" : "rope_pairing") +
               "' is missing (a trace records both RoPE attributes or neither)");
    if (has_pairing) {
        const std::string pairing = r.string_attr(root, "", "rope_pairing");
        if (!parse_rope_pairing(pairing, m.rope.pairing))
            r.fail("root attribute 'rope_pairing' is '" + pairing + "' (expected adjacent or halves)");
        if (m.kind != TraceKind::qkv || m.head_dim % 2 != 0)
            r.fail("root attribute 'rope_frequencies': RoPE is recorded only for a qkv trace of even head_dim");
        m.rope.frequencies = r.double_array_attr(root, "rope_frequencies", static_cast<std::size_t>(m.head_dim / 2), "head_dim / 2");
        for (std::size_t i = 0; i < m.rope.frequencies.size(); ++i)
            if (!(m.rope.frequencies[i] > 0) || !std::isfinite(m.rope.frequencies[i]))
                r.fail("root attribute 'rope_frequencies': element " + std::to_string(i) + " is " +
                       format_float(m.rope.frequencies[i]) + "; frequencies must be positive and finite");
    }
    if (H5Aexists(root, "pre_rope_keys") > 0) {
        m.pre_rope_keys = r.int_attr(root, "", "pre_rope_keys", 0, 1) == 1;
        if (m.pre_rope_keys && !m.rope.known())
            r.fail("root attribute 'pre_rope_keys' is 1 but the trace records no RoPE (rope_pairing, rope_frequencies)");
    }
    m.kvsim_version = r.string_attr(root, "", "kvsim_version");

    const int64_t num_sequences = r.int_attr(root, "", "num_sequences", 1, kInt);
    for (int s = 0; s < num_sequences; ++s) {
        const std::string group_name = sequence_group(s);
        if (H5Lexists(root, "/sequences", r.link_access()) <= 0 || H5Lexists(root, group_name.c_str(), r.link_access()) <= 0)
            r.fail("missing group '" + group_name + "'");
        Handle group = group_handle(H5Gopen2(root, group_name.c_str(), r.group_access()));
        if (!group.valid()) r.fail("'" + group_name + "' is not a group");
        SequenceInfo info;
        info.name = r.string_attr(group.get(), group_name + ": ", "name");
        info.length = r.int_attr(group.get(), group_name + ": ", "length", 2, kMaxTraceTokens,
                                 " (positions are 32-bit; kvsim replays at most 2^30 tokens)");
        r.sequences.push_back(info);
        // Check every dataset's shape, and that its data is there, now: a replay never fails
        // half-way through on a dataset's shape, nor reads zeros the file never held.
        for (int layer = 0; layer < m.num_layers; ++layer) {
            auto check = [&](const std::string& name, const std::vector<hsize_t>& shape) {
                const Handle dataset = r.open_dataset(name, H5T_FLOAT, shape);
                r.check_stored(name, dataset, shape);
            };
            if (m.kind == TraceKind::attention) {
                const hsize_t floats = static_cast<hsize_t>(attention_row_offset(info.length));
                for (int head = 0; head < m.num_query_heads; ++head) check(attention_path(s, layer, head), {floats});
            } else {
                const hsize_t t = info.length, d = m.head_dim;
                check(qkv_path(s, layer, "q"), {t, static_cast<hsize_t>(m.num_query_heads), d});
                check(qkv_path(s, layer, "k"), {t, static_cast<hsize_t>(m.num_kv_heads), d});
                check(qkv_path(s, layer, "v"), {t, static_cast<hsize_t>(m.num_kv_heads), d});
                if (m.pre_rope_keys) check(qkv_path(s, layer, "k_pre_rope"), {t, static_cast<hsize_t>(m.num_kv_heads), d});
            }
        }
        const std::string tokens = group_name + "/tokens";
        if (H5Lexists(root, tokens.c_str(), r.link_access()) > 0) {
            const std::vector<hsize_t> shape = {static_cast<hsize_t>(info.length)};
            r.check_stored(tokens, r.open_dataset(tokens, H5T_INTEGER, shape), shape);
        }
    }
}

TraceReader::~TraceReader() = default;
const std::string& TraceReader::path() const { return impl_->path(); }
const TraceMetadata& TraceReader::metadata() const { return impl_->metadata; }
const std::vector<SequenceInfo>& TraceReader::sequences() const { return impl_->sequences; }

void TraceReader::read_attention_rows(int sequence, int layer, int head, int64_t first_step, int64_t end_step,
                                      std::vector<float>& out) const {
    const std::string name = attention_path(sequence, layer, head);
    const int64_t length = impl_->sequences.at(sequence).length;
    if (first_step < 1 || end_step < first_step || end_step > length)
        throw std::out_of_range("read_attention_rows: steps [" + std::to_string(first_step) + ", " +
                                std::to_string(end_step) + ") outside [1, " + std::to_string(length) + ")");
    Handle dataset = dataset_handle(H5Dopen2(impl_->file(), name.c_str(), impl_->dataset_access()));
    const hsize_t offset = static_cast<hsize_t>(attention_row_offset(first_step));
    const hsize_t count = static_cast<hsize_t>(attention_row_offset(end_step)) - offset;
    out.resize(count);
    if (count == 0) return;
    Handle file_space = space_handle(H5Dget_space(dataset.get()));
    H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, &offset, nullptr, &count, nullptr);
    Handle mem_space = space_handle(H5Screate_simple(1, &count, nullptr));
    if (!dataset.valid() ||
        H5Dread(dataset.get(), H5T_NATIVE_FLOAT, mem_space.get(), file_space.get(), H5P_DEFAULT, out.data()) < 0)
        impl_->fail("cannot read dataset '" + name + "' (truncated or corrupt)");

    // Checked as each block is read, once: every weight a finite number in [0, 1], every row at
    // most 1 in sum (its own weight is the rest). One vectorised pass of integer compares and one
    // of sums, row by row while the row is in cache.
    const float* row = out.data();
    for (int64_t t = first_step; t < end_step; row += t, ++t) {
        const std::size_t bad = first_flagged(row, static_cast<std::size_t>(t), not_weight_bits);
        const uint64_t index = offset + static_cast<uint64_t>(row - out.data());
        if (bad < static_cast<std::size_t>(t))
            impl_->fail("dataset '" + name + "': element " + std::to_string(index + bad) + " (step " +
                        std::to_string(t) + ", position " + std::to_string(bad) + ") is " + format_float(row[bad]) +
                        "; attention weights must be finite and within [0, 1]");
        const double sum = row_sum(row, t);
        if (sum > 1.0 + kRowSumTolerance)
            impl_->fail("dataset '" + name + "': the row of step " + std::to_string(t) + " (elements " +
                        std::to_string(index) + ".." + std::to_string(index + t - 1) + ") sums to " +
                        format_float(sum) + "; a softmax row without its own weight sums to at most 1");
    }
}

QkvLayer TraceReader::read_qkv(int sequence, int layer) const {
    QkvLayer data;
    read_qkv(sequence, layer, data);
    return data;
}

void TraceReader::read_qkv(int sequence, int layer, QkvLayer& data) const {
    const TraceMetadata& m = impl_->metadata;
    if (m.kind != TraceKind::qkv) impl_->fail("is an attention trace; it holds no Q/K/V");
    data.tokens = impl_->sequences.at(sequence).length;
    const hsize_t t = data.tokens, d = m.head_dim;
    // Sizes were checked at open against what the file stores; the layer must also fit in memory.
    const std::string layer_group = sequence_group(sequence) + "/qkv/" + layer_name(layer);
    const uint64_t floats = checked_mul(checked_mul(t, checked_add(m.num_query_heads, 2 * m.num_kv_heads, impl_->path()), impl_->path()),
                                        d, impl_->path() + ": " + layer_group);
    check_memory(checked_mul(floats, sizeof(float), impl_->path()),
                 impl_->path() + ": '" + layer_group + "' (q, k and v of " + std::to_string(t) + " tokens x " +
                     std::to_string(m.num_query_heads) + "+2x" + std::to_string(m.num_kv_heads) + " heads x " +
                     std::to_string(d) + ")");
    impl_->read_tensor(sequence, layer, "q", data.q, m.num_query_heads);
    impl_->read_tensor(sequence, layer, "k", data.k, m.num_kv_heads);
    impl_->read_tensor(sequence, layer, "v", data.v, m.num_kv_heads);
}

void TraceReader::read_pre_rope_keys(int sequence, int layer, std::vector<float>& out) const {
    const TraceMetadata& m = impl_->metadata;
    if (!m.pre_rope_keys)
        impl_->fail("records no keys before RoPE (capture with --pre-rope-keys to record them)");
    const uint64_t floats = checked_mul(checked_mul(static_cast<uint64_t>(impl_->sequences.at(sequence).length),
                                                    static_cast<uint64_t>(m.num_kv_heads), impl_->path()),
                                        static_cast<uint64_t>(m.head_dim), impl_->path());
    check_memory(checked_mul(floats, sizeof(float), impl_->path()),
                 impl_->path() + ": '" + qkv_path(sequence, layer, "k_pre_rope") + "'");
    impl_->read_tensor(sequence, layer, "k_pre_rope", out, m.num_kv_heads);
}

std::vector<int32_t> TraceReader::read_tokens(int sequence) const {
    const std::string name = sequence_group(sequence) + "/tokens";
    if (H5Lexists(impl_->file(), name.c_str(), impl_->link_access()) <= 0) return {};
    const hsize_t length = impl_->sequences.at(sequence).length;
    Handle dataset = impl_->open_dataset(name, H5T_INTEGER, {length});
    check_memory(length * sizeof(int32_t), impl_->path() + ": dataset '" + name + "'");
    std::vector<int32_t> tokens(length);
    impl_->read_all(name, dataset, H5T_NATIVE_INT32, tokens.data());
    return tokens;
}

uint64_t TraceReader::datasets_read_from_chunks() const { return impl_->from_chunks; }

uint64_t TraceReader::file_bytes() const { return std::filesystem::file_size(impl_->path()); }

std::vector<DatasetSize> TraceReader::dataset_sizes() const {
    std::vector<DatasetSize> sizes;
    const TraceMetadata& m = impl_->metadata;
    auto add = [&](const std::string& name) {
        Handle dataset = dataset_handle(H5Dopen2(impl_->file(), name.c_str(), impl_->dataset_access()));
        Handle type = type_handle(H5Dget_type(dataset.get()));
        Handle space = space_handle(H5Dget_space(dataset.get()));
        const uint64_t raw = static_cast<uint64_t>(H5Sget_simple_extent_npoints(space.get())) * H5Tget_size(type.get());
        sizes.push_back({name, raw, H5Dget_storage_size(dataset.get())});
    };
    for (size_t s = 0; s < impl_->sequences.size(); ++s)
        for (int layer = 0; layer < m.num_layers; ++layer) {
            if (m.kind == TraceKind::attention) {
                for (int head = 0; head < m.num_query_heads; ++head) add(attention_path(s, layer, head));
            } else {
                for (const char* tensor : {"q", "k", "v"}) add(qkv_path(s, layer, tensor));
                if (m.pre_rope_keys) add(qkv_path(s, layer, "k_pre_rope"));
            }
        }
    return sizes;
}

}  // namespace kvsim
