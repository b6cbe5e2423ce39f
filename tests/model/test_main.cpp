// doctest's main() for the model tests (kvsim::model): gguf, tokenizer, llama.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
