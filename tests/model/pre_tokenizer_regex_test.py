"""kvsim's hand-written pre-tokenizer scanners against the patterns themselves, run by the Python
`regex` module (which knows \\p{L}/\\p{N}) on random text: letters of several scripts, combining
marks, digits of several kinds, contractions in both cases, Unicode spaces, emoji. Skipped (exit 77)
where `regex` is not installed."""
import random
import subprocess
import sys

try:
    import regex
except ImportError:
    print("SKIPPED: the Python 'regex' module is not installed")
    sys.exit(77)

GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
          r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


def words(pattern, text):
    """The matches, with any unmatched stretch between them as a word of its own (as tokenizers'
    Split pre-tokenizer keeps it)."""
    out, position = [], 0
    for match in regex.finditer(pattern, text):
        if match.start() > position:
            out.append(text[position:match.start()])
        out.append(match.group())
        position = match.end()
    if position < len(text):
        out.append(text[position:])
    return out


REFERENCE = {
    "gpt-2": lambda text: words(GPT2, text),
    "llama-bpe": lambda text: words(LLAMA3, text),
    "qwen2": lambda text: words(QWEN2, text),
    # Digits isolated first, then GPT-2's pattern within each stretch between them.
    "smollm": lambda text: [w for chunk in words(r"\p{N}", text) for w in words(GPT2, chunk)],
}

# \x1c-\x1f are left out: Python counts them as \s, Unicode's White_Space (and Rust's \s) does not.
ALPHABET = ["a", "Z", "é", "ï", "日", "本", "ß", "İ", " ", "  ", "\n", "\r", "\t", "\u3000", "\u00a0", "\u2003",
            "'", "'s", "'S", "'re", "'LL", "'d", "1", "42", "٣", "²", "Ⅻ", ".", "!", "$", "-", "👍", "🏽",
            "\u0301", "_", "\"", "\u200b", "\u2028"]


def main():
    driver = sys.argv[1]
    generator = random.Random(11)
    cases = []
    for _ in range(3000):
        text = "".join(generator.choice(ALPHABET) for _ in range(generator.randint(1, 14)))
        cases += [(name, text) for name in REFERENCE]
    request = "".join(f"{name} {text.encode().hex()}\n" for name, text in cases)
    reply = subprocess.run([driver], input=request, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(reply) == len(cases), (len(reply), len(cases))
    failures = 0
    for (name, text), line in zip(cases, reply):
        got = [bytes.fromhex(word).decode() for word in line.split(",")] if line else []
        expected = REFERENCE[name](text)
        if got != expected:
            failures += 1
            if failures <= 10:
                print(f"{name} {text!r}: kvsim {got}, regex {expected}")
    print(f"{len(cases)} texts, {failures} differ")
    sys.exit(1 if failures else 0)


main()
