// Bad state bytes (F15): every refusal has its exact error code and leaves the cache
// bit-identical (metadata, indexes and every K/V byte).
//   - truncation at every byte offset and every single-bit flip of small valid states;
//   - wrong magic, future and past versions, each fingerprint field, kind/flags/rope scaling word
//     (the pruning table of flags bit 0 is tested in test_ring_state.cpp);
//   - counts beyond capacity or limits, length fields whose products overflow 64 bits;
//   - bad cells (sequence ids, positions, shifts, duplicates where impossible), bad
//     tokens and media, nonzero K padding, trailing bytes, an empty input.
// Patched states get a fresh checksum (reseal) so that the check under test is reached.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "io/io_test_util.hpp"
#include "support/cache_snapshot.hpp"
#include "support/result_check.hpp"

namespace {

using namespace kvtest;
namespace io = kvcache::io;
namespace off = kvcache::io::detail::off;
using kvcache::errc;
using kv_f16 = kvcache::kv_cache<kvcache::f16>;

kvcache::model_shape small_shape() { return io_shape(16, 2, 1, 1, 4); }

/// A small cache: 3 cells of sequence 0 (one shared with 1), pending shift, 1 cell of 1.
kv_f16 small_cache() {
    kv_f16 c(small_shape());
    std::mt19937 rng(7);
    append(c, 0, 3, rng);
    REQUIRE(c.seq_cp(0, 1, 0, 1));
    append(c, 1, 1, rng);
    REQUIRE(c.seq_add(0, 2, -1, 3));
    return c;
}

const std::vector<kvcache::token_t> k_tokens{11, 12, -1, -1, 13};
const std::vector<kvcache::media_chunk> k_media{{99u, 2, 2}};

/// Offset of the first cell record of a state.
std::size_t cells_offset(const std::vector<std::byte>& b) {
    return io::state_header_size + 4 * peek<std::uint64_t>(b, off::n_tokens) +
           16 * peek<std::uint64_t>(b, off::n_media);
}

/// Loads `bytes` (whole or one sequence into dst 1) into a busy cache and checks the
/// code, that the message contains `needle`, and that the cache is bit-identical.
template <class Cache = kv_f16>
void expect_refused(const std::vector<std::byte>& bytes, bool whole, errc code, const std::string& needle = {},
                    const kvcache::model_shape& shape = small_shape(), const io::load_options& opt = {}) {
    Cache d(shape);
    std::mt19937 rng(3);
    append(d, 0, 2, rng);
    append(d, 1, 4, rng);
    const auto before = snapshot(d);
    auto r = whole ? io::load_state(d, bytes, opt) : io::load_seq(d, 1, bytes, opt);
    REQUIRE_FALSE(r.ok());
    CHECK_MESSAGE(r.code() == code, r.message());
    if (!needle.empty()) CHECK_MESSAGE(r.message().find(needle) != std::string::npos, r.message());
    CHECK(snapshot(d) == before);
}

/// The error a valid state gets after flipping one bit at byte i.
errc flip_code(const std::vector<std::byte>& b, std::size_t i, std::uint8_t mask) {
    if (i < 4) return errc::bad_magic;
    if (i < 8) return errc::unsupported_version;
    if (i < 16) {
        std::vector<std::byte> c = b;
        c[i] ^= std::byte{mask};
        const auto total = peek<std::uint64_t>(c, off::total_size);
        if (total < io::state_header_size + io::state_checksum_size || total > c.size()) return errc::truncated;
        return errc::trailing_bytes;
    }
    return errc::checksum_mismatch;
}

}  // namespace

TEST_CASE("truncation at every byte offset is refused as truncated") {
    const kv_f16 c = small_cache();
    for (bool whole : {true, false}) {
        const auto b = whole ? io::save_state(c, k_tokens, k_media) : io::save_seq(c, 0, k_tokens, k_media);
        INFO((whole ? "whole" : "seq") << " state of " << b.size() << " bytes");
        for (std::size_t n = 0; n < b.size(); ++n) {
            INFO("truncated to " << n);
            expect_refused(std::vector<std::byte>(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(n)), whole,
                           errc::truncated);
        }
    }
}

TEST_CASE("every single-bit flip is refused with the code of the field it hits") {
    const kv_f16 c = small_cache();
    for (bool whole : {true, false}) {
        const auto b = whole ? io::save_state(c, k_tokens, k_media) : io::save_seq(c, 0, k_tokens, k_media);
        for (std::size_t i = 0; i < b.size(); ++i)
            for (int bit = 0; bit < 8; ++bit) {
                INFO("byte " << i << " bit " << bit);
                auto x = b;
                x[i] ^= std::byte{static_cast<unsigned char>(1u << bit)};
                expect_refused(x, whole, flip_code(b, i, static_cast<std::uint8_t>(1u << bit)));
            }
    }
}

TEST_CASE("magic, version, kind, flags and trailing bytes") {
    const kv_f16 c = small_cache();
    const auto b = io::save_state(c, k_tokens, k_media);
    expect_refused({}, true, errc::truncated, "0 bytes");
    expect_refused(patched<std::uint32_t>(b, off::magic, 0x46554747u), true, errc::bad_magic, "not a kvcache state");
    expect_refused(patched<std::uint32_t>(b, off::version, 2), true, errc::unsupported_version, "newer");
    expect_refused(patched<std::uint32_t>(b, off::version, 0), true, errc::unsupported_version, "older");
    expect_refused(b, false, errc::unsupported, "use load_state");
    expect_refused(io::save_seq(c, 0), true, errc::unsupported, "use load_seq");
    expect_refused(patched<std::uint32_t>(b, off::kind, 7), true, errc::unsupported, "kind 7");
    expect_refused(patched<std::uint32_t>(b, off::flags, 4), true, errc::unsupported, "only bit 0");
    // Bit 1 (M-RoPE positions) on a state of a cache without M-RoPE sections.
    expect_refused(patched<std::uint32_t>(b, off::flags, 2), true, errc::invalid_cell, "rope.mrope has no sections");
    expect_refused(patched<std::uint32_t>(b, off::flags, 0x80000001u), true, errc::unsupported, "flags");
    expect_refused(patched<std::uint32_t>(b, off::rope_ext, 1), true, errc::shape_mismatch, "rope scaling word");
    auto x = b;
    x.push_back(std::byte{0});
    expect_refused(x, true, errc::trailing_bytes, "after its end");
    // Extra bytes declared in total_size and covered by the checksum: between data and checksum.
    x = b;
    x.insert(x.end() - 8, std::byte{0});
    patch<std::uint64_t>(x, off::total_size, x.size());
    reseal(x);
    expect_refused(x, true, errc::trailing_bytes, "between the K/V data and the checksum");
    x = b;
    x.back() ^= std::byte{1};
    expect_refused(x, true, errc::checksum_mismatch, "stored checksum");
    // The layout kind is informational: a patched layout_id still loads.
    x = b;
    patch<std::uint32_t>(x, off::layout_id, 77);
    reseal(x);
    kv_f16 d(small_shape());
    CHECK(io::load_state(d, x).ok());
}

TEST_CASE("each fingerprint field mismatched") {
    const kv_f16 c = small_cache();
    for (bool whole : {true, false}) {
        const auto b = whole ? io::save_state(c) : io::save_seq(c, 0);
        auto other = [&](auto f) {
            kvcache::model_shape s = small_shape();
            f(s);
            return s;
        };
        expect_refused(b, whole, errc::shape_mismatch, "n_layer = 1 in the state, the cache has 2",
                       other([](auto& s) { s.n_layer = 2; }));
        expect_refused(b, whole, errc::shape_mismatch, "n_head_kv",
                       other([](auto& s) { s.n_head_kv = 2; }));
        expect_refused(b, whole, errc::shape_mismatch, "head_dim_k",
                       other([](auto& s) { s.head_dim_k = 8; s.head_dim_v = 4; }));
        expect_refused(b, whole, errc::shape_mismatch, "head_dim_v = 4 in the state, the cache has 6",
                       other([](auto& s) { s.head_dim_v = 6; }));
        expect_refused(b, whole, errc::shape_mismatch, "rope type",
                       other([](auto& s) { s.rope.type = kvcache::rope_type::neox; }));
        expect_refused(b, whole, errc::shape_mismatch, "rope n_rot",
                       other([](auto& s) { s.rope.n_rot = 2; }));
        // the RoPE floats as numbers (small_shape's freq_base is the default, 10000)
        expect_refused(b, whole, errc::shape_mismatch,
                       "rope freq_base bits = 10000 (bits 0x00000000461c4000) in the state, the cache has 500000 "
                       "(bits 0x0000000048f42400)",
                       other([](auto& s) { s.rope.freq_base = 500000.0f; }));
        expect_refused(b, whole, errc::shape_mismatch, "rope freq_scale",
                       other([](auto& s) { s.rope.freq_scale = 0.25f; }));
        // Same element size, other type (bf16 vs f16); other size (f32).
        expect_refused<kvcache::kv_cache<kvcache::bf16>>(b, whole, errc::dtype_mismatch,
                                                         "element type_id = 1 (f16) in the state, the cache has 2 (bf16)");
        expect_refused<kvcache::kv_cache<kvcache::f32>>(b, whole, errc::dtype_mismatch, "element type_id");
        expect_refused(patched<std::uint32_t>(b, off::elem_size, 4), whole, errc::dtype_mismatch, "element size");
        // Window: a layout with a window refuses a state saved with another one.
        using windowed = kvcache::kv_cache<kvcache::f16, no_shift_layout<8>>;
        // Shifts are pending in the small cache: clear them first so only the window differs.
        kv_f16 c2 = small_cache();
        c2.clear_shifts();
        auto y = whole ? io::save_state(c2) : io::save_seq(c2, 0);
        patch<std::uint32_t>(y, off::window, 16);
        reseal(y);
        expect_refused<windowed>(y, whole, errc::shape_mismatch, "window = 16 in the state, the cache has 8");
        patch<std::uint32_t>(y, off::window, 8);
        reseal(y);
        windowed w(small_shape());
        const bool loaded = whole ? io::load_state(w, y).ok() : io::load_seq(w, 1, y).ok();
        CHECK(loaded);
    }
}

TEST_CASE("counts beyond capacity or limits, and products that overflow 64 bits") {
    const kv_f16 c = small_cache();
    const auto b = io::save_state(c, k_tokens, k_media);
    io::load_options tight;
    tight.max_tokens = 4;
    expect_refused(b, true, errc::no_space, "n_tokens = 5 exceeds the limit 4", small_shape(), tight);

    // More cells than the destination's capacity.
    kvcache::model_shape big = small_shape();
    big.n_cells = 64;
    kv_f16 large(big);
    std::mt19937 rng(11);
    append(large, 0, 20, rng);
    expect_refused(io::save_state(large), true, errc::no_space, "n_cells = 20 exceeds the capacity 16");
    // One sequence: more cells than free (counting dst's own cells, which it replaces).
    append(large, 1, 2, rng);
    auto seq13 = io::save_seq(large, 1);
    kv_f16 busy(small_shape());
    append(busy, 0, 15, rng);
    const auto before = snapshot(busy);
    auto r = io::load_seq(busy, 1, seq13);
    CHECK(r.code() == errc::no_space);
    CHECK(snapshot(busy) == before);

    io::load_options any;
    any.max_tokens = ~std::uint64_t{0};
    expect_refused(patched<std::uint64_t>(b, off::n_tokens, (std::uint64_t{1} << 62) + 1), true, errc::truncated, "more than 2^64", small_shape(), any);
    expect_refused(patched<std::uint64_t>(b, off::n_tokens, std::uint64_t{1} << 40), true, errc::truncated, "n_tokens = 1099511627776 needs", small_shape(), any);
    expect_refused(patched<std::uint64_t>(b, off::n_media, ~std::uint64_t{0} / 8), true, errc::invalid_cell, "n_media", small_shape(), any);
    auto x = b;
    patch<std::uint64_t>(x, off::n_tokens, ~std::uint64_t{0});
    patch<std::uint64_t>(x, off::n_media, ~std::uint64_t{0} / 8);  // 16 * n_media overflows
    reseal(x);
    expect_refused(x, true, errc::truncated, "", small_shape(), any);
    expect_refused(patched<std::uint64_t>(b, off::n_cells, std::uint64_t{1} << 61), true, errc::no_space, "exceeds the capacity 16");
    // Fewer cells than the data holds: sizes no longer add up.
    expect_refused(patched<std::uint64_t>(b, off::n_cells, 0), true, errc::trailing_bytes);
}

TEST_CASE("impossible cells: sequence ids, positions, shifts, duplicates") {
    const kv_f16 c = small_cache();
    const auto b = io::save_state(c, k_tokens, k_media);
    const std::size_t c0 = cells_offset(b);  // pos, shift, n_seq, ids...
    expect_refused(patched(b, c0 + 12, std::int32_t{9}), true, errc::invalid_cell, "sequence id 9 outside [0, 2)");
    expect_refused(patched(b, c0 + 12, std::int32_t{-1}), true, errc::invalid_cell, "sequence id -1");
    expect_refused(patched(b, c0, std::int32_t{-3}), true, errc::invalid_cell, "pos = -3, must be >= 0");
    expect_refused(patched(b, c0 + 4, std::int32_t{1000}), true, errc::invalid_cell, "outside [0, 2^31)");
    expect_refused(patched(b, c0 + 4, std::numeric_limits<std::int32_t>::min()), true, errc::invalid_cell, "outside [0, 2^31)");
    expect_refused(patched(b, c0 + 8, std::uint32_t{0}), true, errc::invalid_cell, "holds 0 sequences");
    expect_refused(patched(b, c0 + 8, std::uint32_t{3}), true, errc::invalid_cell, "holds 3 sequences, must be in [1, 2]");
    // Cell 0 is shared by sequences 0 and 1: make the ids not increasing.
    REQUIRE(peek<std::uint32_t>(b, c0 + 8) == 2);
    expect_refused(patched(b, c0 + 16, std::int32_t{0}), true, errc::invalid_cell, "not strictly increasing");
    // n_seq larger than the bytes left.
    expect_refused(patched(b, c0 + 8, std::uint32_t{0xFFFFFFFFu}), true, errc::invalid_cell);
    // Seq state: the id must be the saved sequence; one id per cell.
    const auto s = io::save_seq(c, 0);
    const std::size_t s0 = cells_offset(s);
    expect_refused(patched(s, s0 + 12, std::int32_t{1}), false, errc::invalid_cell, "holds only sequence 0");
    expect_refused(patched(s, off::seq, std::int32_t{-4}), false, errc::invalid_cell, "seq = -4");
    expect_refused(patched(b, off::seq, std::int32_t{0}), true, errc::invalid_cell, "must be -1 for a whole cache");

    // Pending shifts and duplicate positions: fine where the cache can produce them,
    // refused by a layout that cannot move positions.
    using no_shift = kvcache::kv_cache<kvcache::f16, no_shift_layout<0>>;
    expect_refused<no_shift>(b, true, errc::invalid_cell, "cannot shift");
    kv_f16 dup(small_shape());
    std::mt19937 rng(5);
    append(dup, 0, 4, rng);
    REQUIRE(dup.seq_div(0, 0, -1, 2));
    dup.clear_shifts();
    const auto db = io::save_state(dup);
    kv_f16 ok(small_shape());
    CHECK(io::load_state(ok, db).ok());
    expect_refused<no_shift>(db, true, errc::invalid_cell, "holds position 0 twice");
    expect_refused<no_shift>(io::save_seq(dup, 0), false, errc::invalid_cell, "holds position 0 twice");
}

TEST_CASE("bad tokens, media and K padding") {
    const kv_f16 c = small_cache();
    const auto b = io::save_state(c, k_tokens, k_media);
    const std::size_t t0 = io::state_header_size;
    const std::size_t m0 = t0 + 4 * k_tokens.size();
    expect_refused(patched(b, t0, std::int32_t{-5}), true, errc::invalid_cell, "token[0] = -5");
    expect_refused(patched(b, t0, std::int32_t{-1}), true, errc::invalid_cell, "no media chunk covers it");
    expect_refused(patched(b, t0 + 8, std::int32_t{3}), true, errc::invalid_cell, "must be null_token");
    expect_refused(patched(b, m0 + 8, std::uint32_t{4}), true, errc::invalid_cell, "beyond the 5 tokens");
    expect_refused(patched(b, m0 + 12, std::uint32_t{0}), true, errc::invalid_cell, "n_pos = 0");
    expect_refused(patched(b, m0 + 8, std::uint32_t{0xFFFFFFFFu}), true, errc::invalid_cell, "beyond");
    // A lane past the last cell in the K tile must stay zero (4 cells: lane 4 of d = 0).
    const std::size_t data = b.size() - 8 - (16 * 4 + 4 * 4) * 2;
    auto x = b;
    x[data + 4 * 2] = std::byte{1};
    reseal(x);
    expect_refused(x, true, errc::invalid_cell, "padding");
}
