// State files of an ISWA cache (io/composite.hpp): round trips of the whole memory and
// of one sequence (bytes and session files), and bad input (truncations, byte flips in
// each part, a wrong window, mismatched parts) that must leave both parts bit-identical.
#include <doctest/doctest.h>

#include <fstream>

#include <kvcache/kvcache.hpp>

#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "io_test_util.hpp"
#include "memory/iswa_test_util.hpp"
#include "support/result_check.hpp"

namespace {

using namespace kvcache;
using kvtest::iswa16;

struct iswa_pair {
    iswa16 a{kvtest::iswa_test_shape()};
    iswa16 b{kvtest::iswa_test_shape()};
    std::vector<token_t> toks{5, 6, 7, 8, 9};
    iswa_pair() {
        std::mt19937 rng(7);
        kvtest::iswa_fill(a, 0, 0, 40, rng);  // the ring pruned below 40 - W + 1
        kvtest::iswa_fill(a, 1, 0, 10, rng);
        kvtest::iswa_fill(b, 0, 0, 12, rng);  // something to replace
    }
};

/// Offsets of a composite state: part i starts at part_at(b, i) and has part_size(b, i) bytes.
std::size_t part_size(const std::vector<std::byte>& b, std::size_t i) {
    return static_cast<std::size_t>(kvtest::peek<std::uint64_t>(b, io::composite_header_size + 16 * i + 8));
}
std::size_t part_at(const std::vector<std::byte>& b, std::size_t i) {
    std::size_t at = io::composite_header_size + 2 * io::composite_part_entry_size;
    for (std::size_t k = 0; k < i; ++k) at += part_size(b, k);
    return at;
}
/// Recomputes the checksums of part i and of the composite after a patch.
void reseal_part(std::vector<std::byte>& b, std::size_t i) {
    const std::size_t at = part_at(b, i), n = part_size(b, i);
    const std::uint64_t h = io::checksum(std::span<const std::byte>(b).subspan(at, n - 8));
    std::memcpy(b.data() + at + n - 8, &h, 8);
    kvtest::reseal(b);
}

void refused(iswa16& c, const std::vector<std::byte>& bytes, errc code, const char* what) {
    const auto before = kvtest::iswa_snap(c);
    auto r = io::load_state(c, bytes);
    REQUIRE_FALSE(r.ok());
    CHECK(r.code() == code);
    CHECK_MESSAGE(r.message().find(what) != std::string::npos, r.message());
    CHECK(kvtest::iswa_snap(c) == before);
}

}  // namespace

TEST_CASE("iswa state: the whole memory round-trips through bytes") {
    iswa_pair t;
    const auto bytes = io::save_state(t.a, t.toks);
    CHECK(bytes.size() == io::state_size(t.a, t.toks));
    CHECK(kvtest::peek<std::uint32_t>(bytes, 0) == io::composite_magic);
    std::vector<std::byte> into(bytes.size());
    io::save_state_into(t.a, into, t.toks);
    CHECK(into == bytes);
    auto r = io::load_state(t.b, bytes);
    REQUIRE_MESSAGE(r.ok(), r.message());
    CHECK(r.value().tokens == t.toks);
    CHECK(kvtest::picture(t.b.full()) == kvtest::picture(t.a.full()));
    CHECK(kvtest::picture(t.b.swa()) == kvtest::picture(t.a.swa()));
    for (seq_id_t s = 0; s < 2; ++s) {
        CHECK(t.b.swa().storage().pruned_below(s) == t.a.swa().storage().pruned_below(s));
        CHECK(t.b.seq_pos_max(s) == t.a.seq_pos_max(s));
    }
    CHECK(t.a.swa().storage().pruned_below(0) > 0);
    // The loaded cache saves the same state again (both parts, pruning points, prompt).
    CHECK(io::state_size(t.b, t.toks) == bytes.size());
    // And keeps working: a ring refusal (pruned positions) survives the load.
    CHECK(kvtest::refused_result(t.b.seq_rm(0, 0, 5), "unsupported"));
}

TEST_CASE("iswa state: one sequence round-trips into another sequence") {
    iswa_pair t;
    const auto bytes = io::save_seq(t.a, 0, t.toks);
    CHECK(bytes.size() == io::seq_state_size(t.a, 0, t.toks));
    const auto other = kvtest::picture(t.b.full(), 0, 0);
    auto r = io::load_seq(t.b, 1, bytes);
    REQUIRE_MESSAGE(r.ok(), r.message());
    CHECK(r.value().saved_seq == 0);
    CHECK(r.value().tokens == t.toks);
    CHECK(kvtest::picture(t.b.full(), 1, 1) == kvtest::picture(t.a.full(), 0, 1));
    CHECK(kvtest::picture(t.b.swa(), 1, 1) == kvtest::picture(t.a.swa(), 0, 1));
    CHECK(t.b.swa().storage().pruned_below(1) == t.a.swa().storage().pruned_below(0));
    CHECK(kvtest::picture(t.b.full(), 0, 0) == other);  // sequence 0 untouched
    CHECK_THROWS_AS(static_cast<void>(io::load_seq(t.b, 2, bytes)), kvcache::error);  // dst out of range
    CHECK_THROWS_AS(static_cast<void>(io::save_seq(t.a, -1)), kvcache::error);
    // A whole-memory state is not a sequence state and the other way round.
    auto w = io::load_seq(t.b, 1, io::save_state(t.a));
    CHECK(w.code() == errc::unsupported);
    refused(t.b, bytes, errc::unsupported, "use load_seq");
}

TEST_CASE("iswa state: session files") {
    iswa_pair t;
    const auto dir = std::filesystem::temp_directory_path() / "kvcache_iswa_state_test";
    std::filesystem::create_directories(dir);
    REQUIRE(io::save_file(t.a, dir / "all.kvs", t.toks).ok());
    REQUIRE(io::save_seq_file(t.a, 1, dir / "one.kvs").ok());
    auto r = io::load_file(t.b, dir / "all.kvs");
    REQUIRE_MESSAGE(r.ok(), r.message());
    CHECK(r.value().tokens == t.toks);
    CHECK(kvtest::picture(t.b.swa()) == kvtest::picture(t.a.swa()));
    iswa16 c(kvtest::iswa_test_shape());
    auto r1 = io::load_seq_file(c, 0, dir / "one.kvs");
    REQUIRE_MESSAGE(r1.ok(), r1.message());
    CHECK(kvtest::picture(c.full(), 0, 1) == kvtest::picture(t.a.full(), 1, 1));
    const auto before = kvtest::iswa_snap(c);
    CHECK(io::load_file(c, dir / "missing.kvs").code() == errc::io_error);
    CHECK(kvtest::iswa_snap(c) == before);
    // A file whose part table declares a part larger than that part's header describes is
    // refused from the headers (1 GiB sparse file: nothing read past them).
    {
        std::vector<std::byte> head = io::save_state(t.a);
        const std::uint64_t big = std::uint64_t{1} << 30;
        const std::uint64_t grow = big - head.size();
        kvcache::io::detail::store_le<std::uint64_t>(head.data() + 8, big);
        const std::uint64_t part1 = kvcache::io::detail::load_le<std::uint64_t>(head.data() + 32 + 16 + 8);
        kvcache::io::detail::store_le<std::uint64_t>(head.data() + 32 + 16 + 8, part1 + grow);
        head.resize(head.size() - 8);  // no checksum: the headers are refused first
        {
            std::ofstream f(dir / "big.kvs", std::ios::binary);
            f.write(reinterpret_cast<const char*>(head.data()), static_cast<std::streamsize>(head.size()));
        }
        std::filesystem::resize_file(dir / "big.kvs", big);
        auto r2 = io::load_file(c, dir / "big.kvs");
        CHECK(r2.code() == errc::trailing_bytes);  // part 1 holds more bytes than its own header declares
        CHECK_MESSAGE(r2.message().find("part 1") != std::string::npos, r2.message());
        CHECK(kvtest::iswa_snap(c) == before);
    }
    std::filesystem::remove_all(dir);
}

TEST_CASE("iswa state: truncated or extended bytes leave both parts unchanged") {
    iswa_pair t;
    const auto bytes = io::save_state(t.a, t.toks);
    for (std::size_t cut : {std::size_t{0}, std::size_t{3}, std::size_t{8}, std::size_t{31}, std::size_t{40},
                            std::size_t{64}, part_at(bytes, 1) - 1, part_at(bytes, 1) + 50, bytes.size() / 2,
                            bytes.size() - 9, bytes.size() - 1}) {
        CAPTURE(cut);
        const auto before = kvtest::iswa_snap(t.b);
        auto r = io::load_state(t.b, std::span<const std::byte>(bytes).first(cut));
        CHECK_FALSE(r.ok());
        CHECK(kvtest::iswa_snap(t.b) == before);
    }
    auto longer = bytes;
    longer.push_back(std::byte{0});
    refused(t.b, longer, errc::trailing_bytes, "declares");
}

TEST_CASE("iswa state: a byte flipped in either part is refused, both parts unchanged") {
    iswa_pair t;
    const auto bytes = io::save_state(t.a, t.toks);
    for (std::size_t part : {0u, 1u}) {
        CAPTURE(part);
        const std::size_t at = part_at(bytes, part);
        // Without resealing: the composite checksum catches it.
        for (std::size_t off : {std::size_t{20}, std::size_t{110}, part_size(bytes, part) - 20}) {
            auto b = bytes;
            b[at + off] ^= std::byte{0x40};
            refused(t.b, b, errc::checksum_mismatch, "checksum");
        }
        // Resealed (a deliberate edit): the part's own validation catches it. A bad
        // second part leaves the first part, already parsed, unchanged.
        auto b = bytes;
        const std::size_t n_tokens = part == 0 ? t.toks.size() : 0;
        const std::size_t first_cell = at + io::state_header_size + 4 * n_tokens;
        kvtest::patch<std::uint32_t>(b, first_cell + 8, 0);  // n_seq = 0
        reseal_part(b, part);
        refused(t.b, b, errc::invalid_cell, part == 0 ? "part 0" : "part 1");
        b = bytes;
        kvtest::patch<std::uint32_t>(b, at + io::detail::off::head_dim_k, 16);
        reseal_part(b, part);
        refused(t.b, b, errc::shape_mismatch, "head_dim_k");
        b = bytes;
        kvtest::patch<std::uint32_t>(b, at, 0x12345678u);  // the part's magic
        reseal_part(b, part);
        refused(t.b, b, errc::bad_magic, "magic");
    }
}

TEST_CASE("iswa state: a wrong window or mismatched parts are refused") {
    iswa_pair t;
    const auto bytes = io::save_state(t.a);
    // Another window.
    kvcache::iswa_cache<8, f32> w8(kvtest::iswa_test_shape<8>());
    std::mt19937 rng(3);
    kvtest::iswa_fill(w8, 0, 0, 4, rng);
    const auto before8 = kvtest::iswa_snap(w8);
    auto r = io::load_state(w8, bytes);
    CHECK(r.code() == errc::shape_mismatch);
    CHECK_MESSAGE(r.message().find("window = 16") != std::string::npos, r.message());
    CHECK(kvtest::iswa_snap(w8) == before8);
    // Parts swapped in the part table (a ring state must not go into the full cache).
    auto b = bytes;
    kvtest::patch<std::uint32_t>(b, io::composite_header_size, kvtest::iswa_w);
    kvtest::patch<std::uint32_t>(b, io::composite_header_size + 16, 0);
    kvtest::reseal(b);
    refused(t.b, b, errc::shape_mismatch, "part 0: window");
    // Another part count, composite kind, or layer split.
    refused(t.b, kvtest::patched<std::uint32_t>(bytes, 24, 3), errc::shape_mismatch, "n_parts = 3");
    refused(t.b, kvtest::patched<std::uint32_t>(bytes, 20, 7), errc::shape_mismatch, "composite kind");
    iswa16 split3(kvtest::iswa_test_shape(2, 128, 4));  // 1 full layer, 3 sliding-window layers
    auto r3 = io::load_state(split3, bytes);
    CHECK(r3.code() == errc::shape_mismatch);
    CHECK_MESSAGE(r3.message().find("n_layer") != std::string::npos, r3.message());
    // A single-cache state into an ISWA cache, and an ISWA state into a single cache.
    kv_cache<f32> single(t.a.full().shape());
    refused(t.b, io::save_state(single), errc::bad_magic, "single-cache state");
    const auto before = kvtest::snapshot(single);
    CHECK(io::load_state(single, bytes).code() == errc::bad_magic);
    CHECK(kvtest::snapshot(single) == before);
}

TEST_CASE("iswa state: host errors throw") {
    iswa_pair t;
    std::vector<std::byte> small(8);
    CHECK_THROWS_AS(io::save_state_into(t.a, small), kvcache::error);
    CHECK_THROWS_AS(io::save_seq_into(t.a, 0, small), kvcache::error);
    const std::vector<token_t> bad{-5};
    CHECK_THROWS_AS(static_cast<void>(io::save_state(t.a, bad)), kvcache::error);
    std::vector<pos_t> pos{t.b.seq_pos_max(0) + 1};  // batches continue the last position
    std::vector<seq_id_t> seq{0};
    REQUIRE(t.b.place(pos, seq).ok());
    CHECK_THROWS_AS(static_cast<void>(io::load_state(t.b, io::save_state(t.a))), kvcache::error);
    static_cast<void>(t.b.restore());
}
