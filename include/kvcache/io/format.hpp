// kvcache: the state format (F15), version 1, and its byte-level helpers.
//
// A state is one little-endian byte string; nothing in it depends on the layout's
// cell numbering, so a state saved from one layout loads into another with the
// same model shape and element type.
//
//   offset size  field
//   0      4     magic "KVST"
//   4      4     format version (1)
//   8      8     total_size: bytes of the whole state, checksum included
//   16     4     kind: 0 = whole cache, 1 = one sequence
//   20     4     flags: bit 0 = a pruning table follows the cells; bit 1 = M-RoPE positions
//                follow the cells (set exactly when the cache's rope.mrope has sections);
//                other bits 0
//   24     48    fingerprint: n_layer, n_head_kv, head_dim_k, head_dim_v, element type_id,
//                element size, rope type, rope n_rot, rope freq_base (f32 bits), rope
//                freq_scale (f32 bits), layout_id (informational: states load across
//                layouts), window (0 = none; checked only when state and cache both have one)
//   72     4     seq: the saved sequence for kind 1, -1 for kind 0
//   76     4     rope scaling word: 0 for plain RoPE (type, freq_base, freq_scale, n_rot
//                only), else a nonzero hash of the other rope_params fields in use
//                (io/fingerprint.hpp rope_ext_word); must equal the cache's
//   80     8     n_tokens
//   88     8     n_media
//   96     8     n_cells
//   104          tokens:  n_tokens x i32 (null_token at media positions)
//                media:   n_media x {u64 id, u32 begin, u32 n_pos}
//                cells:   n_cells x {i32 pos, i32 shift, u32 n_seq, n_seq x i32 seq id}
//                         (seq ids strictly increasing; for kind 1 exactly {seq})
//                mrope:   only with flags bit 1: n_cells x {i32 h, i32 w, i32 e} (each >= 0),
//                         the M-RoPE extra positions of the cells, in cell record order
//                pruning: only with flags bit 0: u32 n >= 1, then n x {i32 seq, i32 pruned_below}
//                         (seq ids strictly increasing, each holding a cell; for kind 1
//                         exactly {seq}; 1 <= pruned_below <= that sequence's largest
//                         position + 1): a ring layout's pruning points (layout/ring.hpp),
//                         written only when some saved sequence has one
//                data:    for each layer: K then V, for each KV head:
//                           K: ceil(n_cells/16) tiles of [head_dim_k][16 cells] elements
//                              (rows in dimension order even where the cache keeps NeoX
//                              pair order; lanes past n_cells are zero). The cache's own
//                              K tiles are 32 cells wide (format/kv_view.hpp); the
//                              format keeps 16 so that files do not depend on it
//                           V: n_cells rows of head_dim_v elements
//                         Block elements (elem_size bits 16-31 = values per unit b,
//                         e.g. q8_0: 34 | 32 << 16): "elements" are the cache's storage
//                         units of b values of one cell (format/kv_view.hpp, "Block
//                         elements"): K tiles of [head_dim_k / b][16 cells] units, unit
//                         rows in the cache's row order (NeoX pair order kept: the units
//                         cannot be re-cut without re-quantizing), V rows of
//                         head_dim_v / b units in dimension order.
//                         Units are loaded as they are: every bit pattern is a block
//                         (scales are not checked; the checksum covers them). A block
//                         whose scale is NaN reads back NaN, one whose scale is +-inf
//                         reads +-inf (NaN where its code is 0), as a NaN written into
//                         the cache does (element/q8_0.hpp): the attention rows that
//                         see the cell are NaN, never a silent finite value. A state
//                         whose data ends inside a block is refused (sizes), the cache
//                         unchanged.
//   end-8  8     XXH3-64 of every byte before it
//
// Cells appear in the order of their cell index in the saved cache; the K/V of
// saved cell i is tile i/16, lane i%16 (K) and row i (V).
//
// The rope scaling word came after the first version 1 files, in what was a reserved
// field that had to be 0: every state of plain RoPE is byte-identical to those and they
// all still load; a library from before the word refuses a state of scaled RoPE
// (reserved field not 0), as it must.
// The pruning table came after the first version 1 files: a state without pruning
// points is byte-identical to those (flags 0) and every version 1 file still loads.
// The M-RoPE table came later still: it exists only for caches with M-RoPE sections, whose
// rope scaling word (which hashes the sections) no earlier library accepts anyway.
// A ring loading a state takes its pruning points back (positions below them stay
// refused as before the save); other layouts hold every cell they are given and
// ignore the table.
#pragma once

#include <bit>          // std::endian
#include <cstddef>      // std::byte, std::size_t
#include <cstdint>      // fixed-width integers
#include <cstring>      // std::memcpy
#include <limits>       // overflow checks
#include <optional>     // checked arithmetic
#include <span>         // byte views
#include <string>       // messages

#include "../config.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace io {

static_assert(std::endian::native == std::endian::little,
              "kvcache state I/O writes little-endian data with memcpy; big-endian hosts are not supported");

/// Magic at offset 0: the bytes "KVST".
inline constexpr std::uint32_t state_magic = 0x5453564Bu;
/// Format version written by this library; the only one it reads.
inline constexpr std::uint32_t state_version = 1;
/// Cells per K tile in the format (see "data" above), whatever the cache's k_tile.
inline constexpr std::uint32_t state_k_lanes = 16;
/// The fingerprint's elem_size word: bytes per storage unit in bits 0-15, values per unit
/// in bits 16-31 (0 for one value per unit: f32, f16, bf16, so their words are unchanged).
inline constexpr std::uint32_t elem_size_word(std::size_t unit_bytes, std::uint32_t values) noexcept {
    return static_cast<std::uint32_t>(unit_bytes) | (values > 1 ? values << 16 : 0u);
}
/// Bytes per storage unit of an elem_size word.
inline constexpr std::uint32_t elem_unit_bytes(std::uint32_t word) noexcept { return word & 0xFFFFu; }
/// Values per storage unit of an elem_size word (>= 1).
inline constexpr std::uint32_t elem_unit_values(std::uint32_t word) noexcept {
    return (word >> 16) == 0 ? 1u : word >> 16;
}
/// Bytes before the token list.
inline constexpr std::size_t state_header_size = 104;
/// Bytes of the trailing checksum.
inline constexpr std::size_t state_checksum_size = 8;
/// Flags bit: a table of per-sequence pruning points follows the cell records.
inline constexpr std::uint32_t state_flag_pruning = 1;
/// Flags bit: the cells' M-RoPE extra positions follow the cell records.
inline constexpr std::uint32_t state_flag_mrope = 2;

/// What a state holds.
enum class state_kind : std::uint32_t {
    whole_cache = 0,  ///< every cell of a cache (save_state / load_state)
    one_sequence = 1, ///< the cells of one sequence (save_seq / load_seq)
};

namespace detail {

/// Field offsets of the fixed header (see the table above).
namespace off {
inline constexpr std::size_t magic = 0, version = 4, total_size = 8, kind = 16, flags = 20;
inline constexpr std::size_t n_layer = 24, n_head_kv = 28, head_dim_k = 32, head_dim_v = 36;
inline constexpr std::size_t type_id = 40, elem_size = 44, rope_type = 48, n_rot = 52;
inline constexpr std::size_t freq_base = 56, freq_scale = 60, layout_id = 64, window = 68;
inline constexpr std::size_t seq = 72, rope_ext = 76, n_tokens = 80, n_media = 88, n_cells = 96;
}  // namespace off

/// a * b, or nothing when it overflows 64 bits.
inline std::optional<std::uint64_t> mul_u64(std::uint64_t a, std::uint64_t b) noexcept {
    std::uint64_t r = 0;
    if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
    return r;
}
/// a + b, or nothing when it overflows 64 bits.
inline std::optional<std::uint64_t> add_u64(std::uint64_t a, std::uint64_t b) noexcept {
    std::uint64_t r = 0;
    if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
    return r;
}

/// Trivially copyable value from unaligned bytes.
template <class T>
T load_le(const std::byte* p) noexcept {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
}
/// Trivially copyable value to unaligned bytes.
template <class T>
void store_le(std::byte* p, T v) noexcept {
    std::memcpy(p, &v, sizeof(T));
}

/// Sequential writer into a buffer whose size was computed beforehand.
class byte_writer {
public:
    explicit byte_writer(std::span<std::byte> out) noexcept : p_(out.data()), end_(out.data() + out.size()) {}
    template <class T>
    void put(T v) noexcept {
        KVCACHE_ASSERT(static_cast<std::size_t>(end_ - p_) >= sizeof(T));
        store_le(p_, v);
        p_ += sizeof(T);
    }
    void put_bytes(const void* src, std::size_t n) noexcept {
        KVCACHE_ASSERT(static_cast<std::size_t>(end_ - p_) >= n);
        if (n != 0) std::memcpy(p_, src, n);
        p_ += n;
    }
    /// Reserves n bytes and returns where they start (the caller fills them).
    std::byte* take(std::size_t n) noexcept {
        KVCACHE_ASSERT(static_cast<std::size_t>(end_ - p_) >= n);
        std::byte* r = p_;
        p_ += n;
        return r;
    }
    [[nodiscard]] std::byte* pos() const noexcept { return p_; }

private:
    std::byte* p_;    // next byte to write
    std::byte* end_;  // one past the buffer
};

/// Sequential bounds-checked reader: every read first checks the bytes left.
class byte_reader {
public:
    explicit byte_reader(std::span<const std::byte> in) noexcept : b_(in) {}
    [[nodiscard]] std::size_t offset() const noexcept { return at_; }
    [[nodiscard]] std::size_t left() const noexcept { return b_.size() - at_; }
    /// Whether n more bytes are available.
    [[nodiscard]] bool has(std::uint64_t n) const noexcept { return n <= left(); }
    /// Reads a value; the caller checked has(sizeof(T)).
    template <class T>
    T get() noexcept {
        KVCACHE_ASSERT(has(sizeof(T)));
        T v = load_le<T>(b_.data() + at_);
        at_ += sizeof(T);
        return v;
    }
    /// Skips n bytes and returns where they start; the caller checked has(n).
    const std::byte* take(std::size_t n) noexcept {
        KVCACHE_ASSERT(has(n));
        const std::byte* r = b_.data() + at_;
        at_ += n;
        return r;
    }

private:
    std::span<const std::byte> b_;  // the whole input
    std::size_t at_ = 0;            // invariant: at_ <= b_.size()
};

}  // namespace detail
}  // namespace io
KVCACHE_END_NAMESPACE
