#include "model/text_normalization.h"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>

#include <stdexcept>

#include "base/errors.h"
#include "base/size_limits.h"

namespace kvsim::model {

std::optional<TextNormalization> text_normalization_named(std::string_view name) {
    if (name == "none") return TextNormalization::none;
    if (name == "nfc") return TextNormalization::nfc;
    return std::nullopt;
}

const char* to_string(TextNormalization normalization) {
    return normalization == TextNormalization::nfc ? "nfc" : "none";
}

std::string normalize_nfc(std::string_view text, const std::string& what) {
    // ICU's UTF-8 functions take an int32 length.
    if (text.size() >= (std::size_t{1} << 31))
        throw InputError(what + ": " + format_bytes(text.size()) + " of text; NFC normalises at most 2 GiB at once");
    UErrorCode status = U_ZERO_ERROR;
    const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(status);
    if (U_FAILURE(status)) throw std::runtime_error(std::string("ICU's NFC data: ") + u_errorName(status));
    const icu::StringPiece source(text.data(), static_cast<int32_t>(text.size()));
    if (nfc->isNormalizedUTF8(source, status) && U_SUCCESS(status)) return std::string(text);
    // The text and its normal form, which Unicode bounds at three times the text (UAX #15's
    // expansion factors).
    check_memory(checked_mul(static_cast<uint64_t>(text.size()), 4, what),
                 what + ": NFC normalisation of " + format_bytes(text.size()) + " of text");
    std::string out;
    out.reserve(text.size());
    icu::StringByteSink<std::string> sink(&out);
    status = U_ZERO_ERROR;
    // Ill-formed UTF-8 passes through normalizeUTF8 unchanged (a test holds it to that).
    nfc->normalizeUTF8(0, source, sink, nullptr, status);
    if (U_FAILURE(status)) throw std::runtime_error(std::string("ICU's NFC normalisation: ") + u_errorName(status));
    return out;
}

}  // namespace kvsim::model
