// The llama2.c checkpoint reader: round trip through a file the test writes itself
// (shared and separate classifier), and every kind of broken file refused with a clear error.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>  // getpid: unique scratch file names

#include "../../examples/demo/engine/llama2c.hpp"

namespace {

namespace fs = std::filesystem;

demo::llama_config small_config(bool shared) {
    demo::llama_config c;
    c.dim = 16;
    c.hidden_dim = 40;
    c.n_layers = 3;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.vocab_size = 50;
    c.seq_len = 24;
    c.shared_classifier = shared;
    return c;
}

/// A scratch file removed at the end of the test.
struct temp_file {
    fs::path path;
    explicit temp_file(const std::string& name)
        : path(fs::temp_directory_path() / ("kvcache_demo_test_" + std::to_string(::getpid()) + "_" + name)) {}
    ~temp_file() {
        std::error_code ec;
        fs::remove(path, ec);
    }
};

std::vector<char> read_all(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_all(const fs::path& p, const std::vector<char>& bytes) {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
void set_header_field(std::vector<char>& bytes, int index, std::int32_t value) {
    std::memcpy(bytes.data() + 4 * index, &value, 4);
}

}  // namespace

TEST_CASE("llama2.c checkpoint round trip") {
    for (bool shared : {true, false}) {
        const std::uint64_t seed = shared ? 5 : 6;
        std::printf("llama2.c round trip: seed %llu, shared classifier %d\n", static_cast<unsigned long long>(seed),
                    shared ? 1 : 0);
        const auto w = demo::make_random_model(small_config(shared), seed);
        temp_file f(shared ? "shared.bin" : "separate.bin");
        demo::save_llama2c(w, f.path);
        const std::uint64_t n_floats = demo::detail::llama2c_float_count(w.config);
        CHECK(fs::file_size(f.path) == 28 + 4 * n_floats);
        // The header is the seven int32 of llama2.c, vocab negative for a separate classifier.
        const auto bytes = read_all(f.path);
        std::int32_t hdr[7];
        std::memcpy(hdr, bytes.data(), sizeof hdr);
        CHECK(hdr[0] == 16);
        CHECK(hdr[1] == 40);
        CHECK(hdr[2] == 3);
        CHECK(hdr[3] == 4);
        CHECK(hdr[4] == 2);
        CHECK(hdr[5] == (shared ? 50 : -50));
        CHECK(hdr[6] == 24);
        // Weight order: the embedding follows the header directly, then rms_att of every layer.
        float first = 0, rms0 = 0;
        std::memcpy(&first, bytes.data() + 28, 4);
        std::memcpy(&rms0, bytes.data() + 28 + 4 * 50 * 16, 4);
        CHECK(first == w.tok_embedding[0]);
        CHECK(rms0 == w.layers[0].rms_att[0]);

        const auto r = demo::load_llama2c(f.path);
        CHECK(r.config.dim == 16);
        CHECK(r.config.hidden_dim == 40);
        CHECK(r.config.n_layers == 3);
        CHECK(r.config.n_heads == 4);
        CHECK(r.config.n_kv_heads == 2);
        CHECK(r.config.vocab_size == 50);
        CHECK(r.config.seq_len == 24);
        CHECK(r.config.shared_classifier == shared);
        CHECK(r.tok_embedding == w.tok_embedding);
        REQUIRE(r.layers.size() == 3);
        for (std::size_t l = 0; l < 3; ++l) {
            CHECK(r.layers[l].rms_att == w.layers[l].rms_att);
            CHECK(r.layers[l].wq == w.layers[l].wq);
            CHECK(r.layers[l].wk == w.layers[l].wk);
            CHECK(r.layers[l].wv == w.layers[l].wv);
            CHECK(r.layers[l].wo == w.layers[l].wo);
            CHECK(r.layers[l].rms_ffn == w.layers[l].rms_ffn);
            CHECK(r.layers[l].w1 == w.layers[l].w1);
            CHECK(r.layers[l].w2 == w.layers[l].w2);
            CHECK(r.layers[l].w3 == w.layers[l].w3);
        }
        CHECK(r.rms_final == w.rms_final);
        CHECK(r.wcls == w.wcls);
        CHECK(r.classifier()[7] == w.classifier()[7]);
        CHECK(r.n_params() == w.n_params());
    }
}

TEST_CASE("broken llama2.c checkpoints are refused with a clear error") {
    const auto w = demo::make_random_model(small_config(false), 7);
    temp_file good("good.bin"), bad("bad.bin");
    demo::save_llama2c(w, good.path);
    const auto bytes = read_all(good.path);

    SUBCASE("missing file") {
        CHECK_THROWS_WITH_AS(demo::load_llama2c(good.path.string() + ".missing"), doctest::Contains("cannot open"),
                             demo::model_error);
    }
    SUBCASE("shorter than the header") {
        write_all(bad.path, std::vector<char>(bytes.begin(), bytes.begin() + 20));
        CHECK_THROWS_WITH_AS(demo::load_llama2c(bad.path), doctest::Contains("truncated header"), demo::model_error);
    }
    SUBCASE("truncated weights: both sizes in the message") {
        write_all(bad.path, std::vector<char>(bytes.begin(), bytes.end() - 6));
        const std::string want = "the header announces " + std::to_string(bytes.size()) + " bytes, the file has " +
                                 std::to_string(bytes.size() - 6);
        CHECK_THROWS_WITH_AS(demo::load_llama2c(bad.path), doctest::Contains(want.c_str()), demo::model_error);
    }
    SUBCASE("trailing bytes") {
        auto more = bytes;
        more.resize(more.size() + 8, 0);
        write_all(bad.path, more);
        CHECK_THROWS_WITH_AS(demo::load_llama2c(bad.path), doctest::Contains("8 trailing bytes"), demo::model_error);
    }
    SUBCASE("classifier flag flipped: the size no longer matches") {
        auto b = bytes;
        set_header_field(b, 5, 50);  // claims shared: the file is vocab x dim floats too long
        write_all(bad.path, b);
        CHECK_THROWS_WITH_AS(demo::load_llama2c(bad.path), doctest::Contains("trailing bytes"), demo::model_error);
    }
    struct bad_field {
        int index;
        std::int32_t value;
        const char* message;
    };
    const bad_field cases[] = {
        {0, 0, "dim = 0"},
        {0, -16, "dim = -16"},
        {1, 0, "hidden_dim = 0"},
        {2, -1, "n_layers = -1"},
        {3, 0, "n_heads = 0"},
        {3, 3, "n_heads = 3: must divide dim"},
        {3, 16, "head dimension must be even"},
        {4, 3, "n_kv_heads = 3: must divide n_heads"},
        {4, 8, "n_kv_heads = 8"},
        {5, 0, "vocab_size = 0"},
        {5, INT32_MIN, "vocab_size = 0"},
        {6, 0, "seq_len = 0"},
        {2, 1 << 30, "n_layers"},
    };
    for (const auto& c : cases) {
        CAPTURE(c.index);
        CAPTURE(c.value);
        auto b = bytes;
        set_header_field(b, c.index, c.value);
        write_all(bad.path, b);
        CHECK_THROWS_WITH_AS(demo::load_llama2c(bad.path), doctest::Contains(c.message), demo::model_error);
    }
    // The untouched file still loads.
    CHECK(demo::load_llama2c(good.path).config.dim == 16);
}
