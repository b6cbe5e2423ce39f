#include "model/bpe_pre_tokenizer.h"

#include <unicode/uchar.h>
#include <unicode/utf8.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "base/errors.h"

namespace kvsim::model {

namespace {

// The classes the patterns distinguish: \p{L}, \p{N}, \s (Unicode White_Space, as the Rust and
// Oniguruma engines behind tokenizer.json read \s) and everything else.
enum class CharClass : uint8_t { Letter, Number, Space, Other };

struct Char {
    uint32_t start;   // byte offset in the text
    uint32_t length;  // bytes
    UChar32 code;     // negative for an ill-formed byte sequence
    CharClass cls;
};

CharClass classify(UChar32 code) {
    if (code < 0) return CharClass::Other;
    const uint32_t category = U_GET_GC_MASK(code);
    if (category & U_GC_L_MASK) return CharClass::Letter;
    if (category & U_GC_N_MASK) return CharClass::Number;
    if (u_hasBinaryProperty(code, UCHAR_WHITE_SPACE)) return CharClass::Space;
    return CharClass::Other;
}

std::vector<Char> decode_chars(std::string_view text) {
    std::vector<Char> chars;
    chars.reserve(text.size());
    const auto* bytes = reinterpret_cast<const uint8_t*>(text.data());
    const auto length = static_cast<int32_t>(text.size());
    for (int32_t offset = 0; offset < length;) {
        const int32_t start = offset;
        UChar32 code;
        U8_NEXT(bytes, offset, length, code);  // advances past the character or the ill-formed part
        chars.push_back({static_cast<uint32_t>(start), static_cast<uint32_t>(offset - start), code, classify(code)});
    }
    return chars;
}

// A scanner sees the characters [begin, end) of one chunk: lookahead never crosses `end`, as a
// pattern applied to a chunk cannot see past it.
class Scanner {
  public:
    Scanner(const std::vector<Char>& chars, size_t end) : chars_(chars), end_(end) {}

    // End of the match starting at i (> i) for GPT-2's pattern.
    size_t match_gpt2(size_t i) const {
        if (const size_t contraction = match_contraction(i, /*any_case=*/false)) return contraction;
        // " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+": an optional ASCII space, then a run of one class.
        const size_t after_space = is(i, U' ') ? i + 1 : i;
        if (after_space < end_ && chars_[after_space].cls != CharClass::Space)
            return run_end(after_space, chars_[after_space].cls);
        return match_spaces(i);
    }

    // End of the match starting at i for Llama 3's pattern; Qwen2's has max_digits 1.
    size_t match_llama3(size_t i, size_t max_digits) const {
        if (const size_t contraction = match_contraction(i, /*any_case=*/true)) return contraction;
        const CharClass cls = chars_[i].cls;
        // "[^\r\n\p{L}\p{N}]?\p{L}+": one leading non-letter, non-number (a space, a tab, punctuation)
        // joins the word after it, but never a line break.
        if (cls != CharClass::Letter && cls != CharClass::Number && !is(i, U'\r') && !is(i, U'\n') &&
            class_at(i + 1) == CharClass::Letter)
            return run_end(i + 1, CharClass::Letter);
        if (cls == CharClass::Letter) return run_end(i, CharClass::Letter);
        if (cls == CharClass::Number) return std::min(run_end(i, CharClass::Number), i + max_digits);
        // " ?[^\s\p{L}\p{N}]+[\r\n]*": punctuation takes the line breaks right after it.
        const size_t after_space = is(i, U' ') ? i + 1 : i;
        if (class_at(after_space) == CharClass::Other) {
            size_t j = run_end(after_space, CharClass::Other);
            while (is(j, U'\r') || is(j, U'\n')) ++j;
            return j;
        }
        // "\s*[\r\n]+": whitespace up to and including its last line break.
        const size_t spaces_end = run_end(i, CharClass::Space);
        for (size_t j = spaces_end; j > i; --j) {
            if (is(j - 1, U'\r') || is(j - 1, U'\n')) return j;
        }
        return match_spaces(i);
    }

  private:
    bool is(size_t i, char32_t code) const { return i < end_ && chars_[i].code == static_cast<UChar32>(code); }
    std::optional<CharClass> class_at(size_t i) const {
        if (i >= end_) return std::nullopt;
        return chars_[i].cls;
    }
    size_t run_end(size_t i, CharClass cls) const {
        while (i < end_ && chars_[i].cls == cls) ++i;
        return i;
    }
    bool is_ascii_letter(size_t i, char lower, bool any_case) const {
        return is(i, static_cast<char32_t>(lower)) || (any_case && is(i, static_cast<char32_t>(lower - 'a' + 'A')));
    }

    // "'s|'t|'re|'ve|'m|'ll|'d" (ASCII letters either case when any_case); 0 when none matches.
    size_t match_contraction(size_t i, bool any_case) const {
        if (!is(i, U'\'')) return 0;
        for (const char letter : {'s', 't', 'm', 'd'}) {
            if (is_ascii_letter(i + 1, letter, any_case)) return i + 2;
        }
        for (const char* pair : {"re", "ve", "ll"}) {
            if (is_ascii_letter(i + 1, pair[0], any_case) && is_ascii_letter(i + 2, pair[1], any_case)) return i + 3;
        }
        return 0;
    }

    // "\s+(?!\S)|\s+" at a whitespace character: a run of spaces leaves its last one to the word
    // after it (so " word" keeps its space), unless the run ends the chunk or is a single space.
    size_t match_spaces(size_t i) const {
        const size_t spaces_end = run_end(i, CharClass::Space);
        if (spaces_end == end_ || spaces_end - i == 1) return spaces_end;
        return spaces_end - 1;
    }

    const std::vector<Char>& chars_;
    size_t end_;
};

}  // namespace

std::optional<PreTokenizer> pre_tokenizer_named(std::string_view name) {
    if (name == "gpt-2") return PreTokenizer::Gpt2;
    if (name == "llama-bpe" || name == "llama3" || name == "llama-v3") return PreTokenizer::Llama3;
    if (name == "qwen2" || name == "deepseek-r1-qwen") return PreTokenizer::Qwen2;
    if (name == "smollm") return PreTokenizer::SmolLM;
    return std::nullopt;
}

std::vector<std::string_view> pre_tokenize(std::string_view text, PreTokenizer kind) {
    if (text.size() >= static_cast<size_t>(std::numeric_limits<int32_t>::max()))
        throw InputError("text of " + std::to_string(text.size()) + " bytes is too long to pre-tokenize as one sequence");
    const std::vector<Char> chars = decode_chars(text);
    std::vector<std::string_view> words;
    const auto add_word = [&](size_t first, size_t last) {  // characters [first, last)
        const uint32_t start = chars[first].start;
        words.push_back(text.substr(start, chars[last - 1].start + chars[last - 1].length - start));
    };
    const auto scan = [&](size_t begin, size_t end, auto match) {
        const Scanner scanner(chars, end);
        for (size_t i = begin; i < end;) {
            const size_t next = match(scanner, i);
            add_word(i, next);
            i = next;
        }
    };
    switch (kind) {
        case PreTokenizer::Gpt2:
            scan(0, chars.size(), [](const Scanner& s, size_t i) { return s.match_gpt2(i); });
            break;
        case PreTokenizer::Llama3:
            scan(0, chars.size(), [](const Scanner& s, size_t i) { return s.match_llama3(i, 3); });
            break;
        case PreTokenizer::Qwen2:
            scan(0, chars.size(), [](const Scanner& s, size_t i) { return s.match_llama3(i, 1); });
            break;
        case PreTokenizer::SmolLM:
            for (size_t i = 0; i < chars.size();) {
                if (chars[i].cls == CharClass::Number) {
                    add_word(i, i + 1);
                    ++i;
                    continue;
                }
                size_t chunk_end = i;
                while (chunk_end < chars.size() && chars[chunk_end].cls != CharClass::Number) ++chunk_end;
                scan(i, chunk_end, [](const Scanner& s, size_t j) { return s.match_gpt2(j); });
                i = chunk_end;
            }
            break;
    }
    return words;
}

}  // namespace kvsim::model
