// Tokenizers of the demo: byte level, and llama2.c's tokenizer.bin (BPE merges by score)
// read from a small vocabulary file the test writes itself, plus broken files.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>  // getpid: unique scratch file names

#include "../../examples/demo/engine/tokenizer.hpp"

namespace {

namespace fs = std::filesystem;
using demo::token_t;

struct entry {
    std::string piece;
    float score;
};

/// Llama's layout: <unk>, <s>, </s>, the 256 byte tokens, then a few merges.
std::vector<entry> small_vocab() {
    std::vector<entry> v{{"<unk>", 0}, {"\n<s>\n", 0}, {"\n</s>\n", 0}};
    for (int b = 0; b < 256; ++b) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "<0x%02X>", b);
        v.push_back({buf, 0});
    }
    v.push_back({" ", -1});         // 259
    v.push_back({"a", -1});         // 260
    v.push_back({"b", -1});         // 261
    v.push_back({"ab", 1});         // 262
    v.push_back({" ab", 2});        // 263
    v.push_back({"\xC3\xA9", -1});  // 264: "é"
    return v;
}

fs::path scratch(const std::string& name) {
    return fs::temp_directory_path() / ("kvcache_demo_tok_" + std::to_string(::getpid()) + "_" + name);
}

void write_vocab(const fs::path& p, const std::vector<entry>& v, std::int32_t max_len = 16) {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(&max_len), 4);
    for (const entry& e : v) {
        const auto len = static_cast<std::int32_t>(e.piece.size());
        out.write(reinterpret_cast<const char*>(&e.score), 4);
        out.write(reinterpret_cast<const char*>(&len), 4);
        out.write(e.piece.data(), len);
    }
}

}  // namespace

TEST_CASE("byte-level tokenizer") {
    const demo::tokenizer t(259);
    CHECK(t.byte_level());
    CHECK(t.encode("AB", true) == std::vector<token_t>{1, 3 + 'A', 3 + 'B'});
    CHECK(t.encode("", false).empty());
    CHECK(t.decode(t.encode("hello, world", true)) == "hello, world");
    CHECK(t.piece(-1, 2).empty());    // EOS has no text
    CHECK(t.piece(-1, 300).empty());  // out of range
    const demo::tokenizer small(10);  // bytes wrap into ids [3, 10)
    for (token_t id : small.encode("xyz", false)) CHECK((id >= 3 && id < 10));
    CHECK_THROWS_WITH_AS(demo::tokenizer(3), doctest::Contains("vocab_size = 3"), demo::model_error);
}

TEST_CASE("llama2.c tokenizer.bin: merges by score, byte fallback, decoding") {
    const auto v = small_vocab();
    const fs::path p = scratch("vocab.bin");
    write_vocab(p, v);
    const auto t = demo::tokenizer::load_llama2c(p, static_cast<int>(v.size()));
    fs::remove(p);
    CHECK_FALSE(t.byte_level());
    // " " + "a" + "b" -> " " + "ab" (score 1) -> " ab" (score 2).
    CHECK(t.encode("ab", true) == std::vector<token_t>{1, 263});
    // " ab" then " " and "b": " b" is not in the vocabulary.
    CHECK(t.encode("ab b", false) == std::vector<token_t>{263, 259, 261});
    // A known two-byte character is one token; an unknown one falls back to its bytes.
    CHECK(t.encode("\xC3\xA9", false) == std::vector<token_t>{259, 264});
    CHECK(t.encode("\xC3\xA7", false) == std::vector<token_t>{259, 3 + 0xC3, 3 + 0xA7});
    CHECK(t.encode("", false).empty());
    // Decoding: the leading space after BOS goes, byte tokens become bytes, specials vanish.
    CHECK(t.piece(1, 263) == "ab");
    CHECK(t.piece(261, 263) == " ab");
    CHECK(t.piece(0, 3 + 'A') == "A");
    CHECK(t.piece(0, 2).empty());
    CHECK(t.decode({1, 263, 259, 261, 2}) == "ab b");
}

TEST_CASE("broken tokenizer.bin files are refused with a clear error") {
    const auto v = small_vocab();
    const int n = static_cast<int>(v.size());
    const fs::path p = scratch("bad.bin");
    CHECK_THROWS_WITH_AS(demo::tokenizer::load_llama2c(p, n), doctest::Contains("cannot open"), demo::model_error);
    {
        std::ofstream out(p, std::ios::binary);
        out.write("\x01\x00", 2);
    }
    CHECK_THROWS_WITH_AS(demo::tokenizer::load_llama2c(p, n), doctest::Contains("truncated header"), demo::model_error);
    write_vocab(p, v, 0);
    CHECK_THROWS_WITH_AS(demo::tokenizer::load_llama2c(p, n), doctest::Contains("max_token_length = 0"),
                         demo::model_error);
    write_vocab(p, v, 3);  // "<unk>" is longer than 3
    CHECK_THROWS_WITH_AS(demo::tokenizer::load_llama2c(p, n), doctest::Contains("token 0 has length 5"),
                         demo::model_error);
    write_vocab(p, v);
    CHECK_THROWS_WITH_AS(demo::tokenizer::load_llama2c(p, n + 1), doctest::Contains("truncated at token 265 of 266"),
                         demo::model_error);
    // Cut inside the last token's bytes.
    const auto size = fs::file_size(p);
    fs::resize_file(p, size - 1);
    CHECK_THROWS_WITH_AS(demo::tokenizer::load_llama2c(p, n), doctest::Contains("truncated inside token 264"),
                         demo::model_error);
    fs::remove(p);
}
