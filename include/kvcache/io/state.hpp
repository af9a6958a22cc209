// kvcache: saving and loading cache state (F15): a whole cache or one sequence, to
// bytes or to a session file. The format is described in io/format.hpp.
//
// Loading never trusts its input: it parses and validates everything (sizes,
// checksum, model fingerprint, counts against capacity, every cell and token) into
// staging first, and only then changes the cache. On any failure the result carries
// a specific errc with expected-versus-actual values and the cache is unchanged.
//
//     auto bytes = kvcache::io::save_seq(cache, 0, tokens);       // std::vector<std::byte>
//     auto r = kvcache::io::load_seq(other_cache, 3, bytes);       // into sequence 3
//     if (!r) std::fprintf(stderr, "%s\n", r.message().c_str());  // cache untouched
//
// Host-argument errors (a sequence id out of range, placements staged, an output
// span of the wrong size) throw kvcache::error like the rest of the library.
#pragma once

#include <algorithm>    // std::sort, std::adjacent_find
#include <cstddef>      // std::byte, std::size_t
#include <cstdint>      // fixed-width integers
#include <cstdio>       // std::snprintf for hex values in messages
#include <cstring>      // std::memcpy, std::memset
#include <filesystem>   // session file paths
#include <limits>       // INT32_MAX
#include <optional>     // optional error messages
#include <span>         // inputs and outputs
#include <string>       // messages
#include <utility>      // std::pair, std::move
#include <vector>       // buffers and staging

// Header-only use of Debian's libxxhash-dev (nothing to link). With AVX-512 enabled,
// GCC 12 reports a false -Wuninitialized inside its own AVX-512 intrinsics that xxHash's
// AVX-512 path inlines, so that path is replaced by the AVX2 one (still faster than DRAM
// per core). Define XXH_VECTOR yourself to choose another.
#define XXH_INLINE_ALL
#if !defined(XXH_VECTOR) && defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#define XXH_VECTOR 2  // XXH_AVX2
#endif
#include <xxhash.h>

#include "../cells/cell_table.hpp"
#include "../detail/policy_select.hpp"
#include "../error.hpp"
#include "../format/kv_view.hpp"
#include "../layout/capabilities.hpp"
#include "../model_shape.hpp"
#include "../tokens/token.hpp"
#include "file.hpp"
#include "format.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace io {

/// What a successful load restored.
struct load_info {
    state_kind kind = state_kind::whole_cache;
    seq_id_t saved_seq = -1;             ///< sequence the bytes were saved from (one_sequence), else -1
    std::vector<std::uint32_t> cells;    ///< cell that saved cell i went to
    std::vector<token_t> tokens;         ///< prompt tokens stored with the state (may be empty)
    std::vector<media_chunk> media;      ///< media chunks covering null_token positions of `tokens`
};

/// Limits applied while loading untrusted bytes.
struct load_options {
    /// Largest token list accepted (errc::no_space beyond it). Positions are 31-bit, so
    /// the default accepts every list a cache can describe.
    std::uint64_t max_tokens = std::uint64_t{1} << 31;
};

/// XXH3-64 of `bytes`: the checksum stored in the last 8 bytes of a state.
[[nodiscard]] inline std::uint64_t checksum(std::span<const std::byte> bytes) noexcept {
    return XXH3_64bits(bytes.data(), bytes.size());
}

namespace detail {

using kvcache::detail::internal_access;
using kvcache::detail::make_error;

inline std::string hex(std::uint64_t v) {
    char buf[24];
    std::snprintf(buf, sizeof(buf), "0x%016llx", static_cast<unsigned long long>(v));
    return buf;
}

/// The first problem of a token list with media chunks (F18 invariants), or nothing.
inline std::optional<std::string> check_tokens(std::span<const token_t> tokens, std::span<const media_chunk> media) {
    std::uint64_t next_free = 0;  // first position after the previous chunk
    for (std::size_t m = 0; m < media.size(); ++m) {
        const media_chunk& c = media[m];
        const std::string name = "media[" + std::to_string(m) + "]";
        const std::uint64_t end = std::uint64_t{c.begin} + c.n_pos;
        if (c.n_pos == 0) return name + ".n_pos = 0, must be >= 1";
        if (end > tokens.size())
            return name + " covers [" + std::to_string(c.begin) + ", " + std::to_string(end) + ") beyond the " +
                   std::to_string(tokens.size()) + " tokens";
        if (c.begin < next_free)
            return name + ".begin = " + std::to_string(c.begin) + " overlaps or precedes the previous chunk (ends at " +
                   std::to_string(next_free) + ")";
        next_free = end;
    }
    std::size_t m = 0;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
        while (m < media.size() && std::uint64_t{media[m].begin} + media[m].n_pos <= i) ++m;
        const bool covered = m < media.size() && media[m].begin <= i;
        if (covered && tokens[i] != null_token)
            return "token[" + std::to_string(i) + "] = " + std::to_string(tokens[i]) + " inside media[" +
                   std::to_string(m) + "], must be null_token";
        if (!covered && tokens[i] < 0)
            return "token[" + std::to_string(i) + "] = " + std::to_string(tokens[i]) +
                   (tokens[i] == null_token ? " (null_token) but no media chunk covers it" : ", must be >= 0");
    }
    return std::nullopt;
}

/// Everything the bytes depend on besides the cells (the fingerprint of format.hpp).
struct fingerprint {
    std::uint32_t n_layer, n_head_kv, head_dim_k, head_dim_v, type_id, elem_size;
    std::uint32_t rope_type, n_rot, freq_base_bits, freq_scale_bits, layout_id, window;
};

/// The attention window of a layout (0 when it keeps every cell).
template <class Cache>
std::uint32_t layout_window(const Cache& cache) noexcept {
    if constexpr (cache_has_capability<Cache, layout_caps::sliding_window>())
        return static_cast<std::uint32_t>(cache.storage().window());
    else
        return 0;
}

template <class Cache>
fingerprint fingerprint_of(const Cache& cache) noexcept {
    const model_shape& s = cache.shape();
    fingerprint f{};
    f.n_layer = s.n_layer;
    f.n_head_kv = s.n_head_kv;
    f.head_dim_k = s.dim_k();
    f.head_dim_v = s.dim_v();
    f.type_id = static_cast<std::uint32_t>(Cache::element::type_id);
    f.elem_size = static_cast<std::uint32_t>(sizeof(typename Cache::storage_type));
    f.rope_type = static_cast<std::uint32_t>(s.rope.type);
    f.n_rot = s.n_rot();
    std::memcpy(&f.freq_base_bits, &s.rope.freq_base, 4);
    std::memcpy(&f.freq_scale_bits, &s.rope.freq_scale, 4);
    f.layout_id = static_cast<std::uint32_t>(Cache::layout::layout_id);
    f.window = layout_window(cache);
    return f;
}

template <class Cache>
constexpr void require_raw_view() {
    static_assert(requires(const typename Cache::storage_t& s) { s.view(0u).k_offset(0u, 0u, 0u); },
                  "kvcache::io: state I/O needs a layout storage with view(layer) returning a kv_layer_view "
                  "(see format/kv_view.hpp)");
}

/// How the K/V of saved cell i (format order) maps to cell map[i] of the storage. A
/// format K tile (state_k_lanes cells) whose cells are 16 consecutive storage cells
/// starting at a multiple of 16 is one aligned part of a storage tile: each of its rows
/// moves as one 16-lane memcpy. Runs of consecutive V rows become single memcpys.
struct copy_plan {
    struct run {
        std::uint32_t from;  ///< first saved format tile (K) or saved cell (V)
        std::uint32_t to;    ///< first storage 16-cell group (K) or cell (V); unused for lane segments
        std::uint32_t len;   ///< format tiles (K) or cells (V)
        bool lanes;          ///< K: one saved tile whose cells are copied one by one
    };
    std::vector<run> k_segs;  ///< every saved format tile in order: runs of aligned tiles, or lane segments
    std::vector<run> v_runs;  ///< every saved cell in order: consecutive saved cells in consecutive storage cells
    std::uint32_t n_cells = 0;
    std::uint32_t n_tiles = 0;  ///< format tiles: ceil(n_cells / state_k_lanes)
};
static_assert(k_tile % state_k_lanes == 0, "a format K tile must be an aligned part of a storage K tile");

/// Appends {from, to, 1} to runs, or extends the last run when both sides continue it.
inline void add_to_run(std::vector<copy_plan::run>& runs, std::uint32_t from, std::uint32_t to, bool lanes) {
    if (!lanes && !runs.empty() && !runs.back().lanes && runs.back().from + runs.back().len == from &&
        runs.back().to + runs.back().len == to)
        ++runs.back().len;
    else
        runs.push_back({from, to, 1, lanes});
}

inline copy_plan make_copy_plan(std::span<const std::uint32_t> map) {
    copy_plan p;
    p.n_cells = static_cast<std::uint32_t>(map.size());
    constexpr std::uint32_t w = state_k_lanes;
    p.n_tiles = (p.n_cells + w - 1) / w;
    for (std::uint32_t t = 0; t < p.n_tiles; ++t) {
        const std::uint32_t first = t * w;
        bool aligned = first + w <= p.n_cells && map[first] % w == 0;
        for (std::uint32_t j = 1; aligned && j < w; ++j) aligned = map[first + j] == map[first] + j;
        add_to_run(p.k_segs, t, aligned ? map[first] / w : 0, !aligned);
    }
    for (std::uint32_t i = 0; i < p.n_cells; ++i) add_to_run(p.v_runs, i, map[i], false);
    return p;
}

/// Bytes of one layer's K (all heads) and V (all heads) in the format.
struct layer_sizes {
    std::uint64_t k_head, v_head, layer;
};

inline std::optional<layer_sizes> sizes_for(const fingerprint& f, std::uint64_t n_cells) {
    const std::uint64_t tiles = (n_cells + state_k_lanes - 1) / state_k_lanes;
    const auto k_elems = mul_u64(tiles, std::uint64_t{state_k_lanes} * f.head_dim_k);
    const auto v_elems = mul_u64(n_cells, f.head_dim_v);
    if (!k_elems || !v_elems) return std::nullopt;
    const auto k_head = mul_u64(*k_elems, f.elem_size);
    const auto v_head = mul_u64(*v_elems, f.elem_size);
    if (!k_head || !v_head) return std::nullopt;
    const auto kv = add_u64(*k_head, *v_head);
    if (!kv) return std::nullopt;
    const auto layer = mul_u64(*kv, f.n_head_kv);
    if (!layer) return std::nullopt;
    return layer_sizes{*k_head, *v_head, *layer};
}

/// Moves one layer's K/V between the storage cells in `map` and the format bytes at
/// `fmt`: Save copies storage -> format and feeds the format bytes to `hash` in file
/// order, in chunks small enough to be hashed while still in cache; !Save copies
/// format -> storage. T is const for Save.
template <bool Save, class T, class B>
void transfer_layer(const kv_layer_view<T>& v, const copy_plan& p, std::span<const std::uint32_t> map, B* fmt,
                    XXH3_state_t* hash) {
    constexpr std::size_t es = sizeof(T);
    auto move = [&](std::size_t f, T* s, std::size_t n) {  // n bytes at format offset f <-> storage s
        if constexpr (Save)
            std::memcpy(fmt + f, s, n);
        else
            std::memcpy(s, fmt + f, n);
    };
    auto hashed = [&](std::size_t f, std::size_t n) {
        if constexpr (Save) XXH3_64bits_update(hash, fmt + f, n);
    };
    constexpr std::uint32_t w = state_k_lanes;
    const std::size_t tile_bytes = std::size_t{w} * v.dim_k * es;  // one format K tile
    const std::size_t row_bytes = std::size_t{v.dim_v} * es;
    // A format tile's rows are 16 lanes of one dimension, in dimension order; in the
    // storage they are part of a k_tile-wide row, in RoPE pair order (format/kv_view.hpp,
    // which differs for NeoX): an aligned tile moves row by row, 16 lanes at a time.
    std::size_t at = 0;  // format offset of the current head's K or V block
    for (std::uint32_t h = 0; h < v.n_head_kv; ++h, at += std::size_t{p.n_tiles} * tile_bytes) {
        for (const auto& sg : p.k_segs) {
            const std::size_t f0 = at + sg.from * tile_bytes;
            if (!sg.lanes) {
                for (std::uint32_t t = 0; t < sg.len; ++t) {
                    const std::uint32_t c0 = (sg.to + t) * w;  // first storage cell
                    T* part = v.k_tile_ptr(h, c0 / k_tile) + c0 % k_tile;
                    const std::size_t ft = f0 + t * tile_bytes;
                    for (std::uint32_t d = 0; d < v.dim_k; ++d)
                        move(ft + std::size_t{d} * w * es, part + std::size_t{v.k_row(d)} * k_tile, w * es);
                    hashed(ft, tile_bytes);
                }
                continue;
            }
            const std::uint32_t n = std::min(w, p.n_cells - sg.from * w);
            if constexpr (Save)
                if (n < w) std::memset(fmt + f0, 0, tile_bytes);  // lanes past n_cells stay zero
            std::size_t base[w];  // dimension d of lane j is at v.k[base[j] + k_row(d) * k_tile]
            for (std::uint32_t j = 0; j < n; ++j) base[j] = v.k_offset(h, map[sg.from * w + j], 0);
            for (std::uint32_t d = 0; d < v.dim_k; ++d)
                for (std::uint32_t j = 0; j < n; ++j)
                    move(f0 + (std::size_t{d} * w + j) * es, v.k + base[j] + std::size_t{v.k_row(d)} * k_tile, es);
            hashed(f0, tile_bytes);
        }
    }
    for (std::uint32_t h = 0; h < v.n_head_kv; ++h, at += std::size_t{p.n_cells} * row_bytes) {
        if (v.vl == v_layout::row_major) {
            // The format's V rows are whole; the storage keeps each tile's rows as blocks of
            // v_block dimensions (format/kv_view.hpp). Per stretch of a run inside one
            // storage tile (at most 32 cells, 8 KiB for f16 heads of 128): block by block,
            // so the storage side of each block is one contiguous run and the format side
            // stays in L1, then the stretch is hashed while it is still there.
            for (const auto& r : p.v_runs) {
                for (std::uint32_t i = 0; i < r.len;) {
                    const std::uint32_t c0 = r.to + i;
                    const std::uint32_t seg = std::min(r.len - i, k_tile - c0 % k_tile);
                    const std::size_t f0 = at + (std::size_t{r.from} + i) * row_bytes;
                    for (std::uint32_t d0 = 0; d0 < v.dim_v; d0 += v_block) {
                        T* piece = v.v + v.v_offset(h, c0, d0);  // cells c0.. of this block, back to back
                        const std::uint32_t w = std::min(v_block, v.dim_v - d0);
                        if (w == v_block) {
                            for (std::uint32_t j = 0; j < seg; ++j)
                                move(f0 + j * row_bytes + d0 * es, piece + std::size_t{j} * v_block, v_block * es);  // constant size: inlined
                        } else {
                            for (std::uint32_t j = 0; j < seg; ++j)
                                move(f0 + j * row_bytes + d0 * es, piece + std::size_t{j} * w, w * es);
                        }
                    }
                    hashed(f0, std::size_t{seg} * row_bytes);
                    i += seg;
                }
            }
            continue;
        }
        for (std::uint32_t i = 0; i < p.n_cells; ++i) {
            for (std::uint32_t d = 0; d < v.dim_v; ++d) move(at + i * row_bytes + d * es, v.v + v.v_offset(h, map[i], d), es);
            hashed(at + i * row_bytes, row_bytes);
        }
    }
}

/// The cells a save covers, in cell order: every used cell, or those of sequence `seq`.
template <class Cache>
std::vector<std::uint32_t> cells_to_save(const Cache& cache, seq_id_t seq) {
    const cell_table& ct = cache.cells();
    std::vector<std::uint32_t> out;
    out.reserve(seq < 0 ? ct.used() : ct.seq_cell_count(seq));
    for (std::uint32_t c : ct.used_cells())
        if (seq < 0 || ct.seqs(c).test(seq)) out.push_back(c);
    return out;
}

template <class Cache>
void check_save_args(const char* fn, const Cache& cache, bool one_seq, seq_id_t seq, std::span<const token_t> tokens,
                     std::span<const media_chunk> media) {
    if (cache.in_transaction())
        kvcache::detail::fail(errc::transaction_open,
                              std::string(fn) + ": placements are staged; commit() or restore() first");
    if (one_seq && (seq < 0 || static_cast<std::uint32_t>(seq) >= cache.shape().n_seq_max))
        kvcache::detail::fail(errc::invalid_argument, std::string(fn) + ": seq = " + std::to_string(seq) +
                                                          ", must be in [0, " +
                                                          std::to_string(cache.shape().n_seq_max) + ")");
    if (auto bad = check_tokens(tokens, media))
        kvcache::detail::fail(errc::invalid_argument, std::string(fn) + ": tokens/media: " + *bad);
}

/// (sequence, pruning point) of every saved sequence whose positions below that point a
/// ring layout pruned (storage hook pruned_below); empty for other layouts.
template <class Cache>
std::vector<std::pair<seq_id_t, pos_t>> pruning_entries(const Cache& cache, seq_id_t seq) {
    std::vector<std::pair<seq_id_t, pos_t>> out;
    if constexpr (cache_has_capability<Cache, layout_caps::pruning>()) {
        const auto n_seq = static_cast<seq_id_t>(cache.shape().n_seq_max);
        for (seq_id_t s = seq < 0 ? 0 : seq; s < (seq < 0 ? n_seq : seq + 1); ++s)
            if (const pos_t w = cache.storage().pruned_below(s); w > 0) out.emplace_back(s, w);
    }
    return out;
}

/// Bytes of the state of `cells` (no overflow possible: a cache that exists fits in memory).
template <class Cache>
std::size_t state_bytes(const Cache& cache, std::span<const std::uint32_t> cells, seq_id_t seq,
                        std::size_t n_tokens, std::size_t n_media) {
    std::size_t n = state_header_size + n_tokens * 4 + n_media * 16 + cells.size() * 12;
    if (const std::size_t np = pruning_entries(cache, seq).size(); np != 0) n += 4 + np * 8;
    for (std::uint32_t c : cells) n += 4 * (seq < 0 ? static_cast<std::size_t>(cache.cells().seqs(c).count()) : 1);
    return n + static_cast<std::size_t>(sizes_for(fingerprint_of(cache), cells.size())->layer) *
                   cache.shape().n_layer + state_checksum_size;
}

template <class Cache>
void write_state(const Cache& cache, std::span<const std::uint32_t> cells, seq_id_t seq,
                 std::span<const token_t> tokens, std::span<const media_chunk> media, std::span<std::byte> out) {
    const fingerprint f = fingerprint_of(cache);
    const cell_table& ct = cache.cells();
    const auto pruning = pruning_entries(cache, seq);
    byte_writer w(out);
    w.put<std::uint32_t>(state_magic);
    w.put<std::uint32_t>(state_version);
    w.put<std::uint64_t>(out.size());
    w.put<std::uint32_t>(static_cast<std::uint32_t>(seq < 0 ? state_kind::whole_cache : state_kind::one_sequence));
    w.put<std::uint32_t>(pruning.empty() ? 0u : state_flag_pruning);
    for (std::uint32_t x : {f.n_layer, f.n_head_kv, f.head_dim_k, f.head_dim_v, f.type_id, f.elem_size, f.rope_type,
                            f.n_rot, f.freq_base_bits, f.freq_scale_bits, f.layout_id, f.window})
        w.put<std::uint32_t>(x);
    w.put<std::int32_t>(seq < 0 ? -1 : seq);
    w.put<std::uint32_t>(0);  // reserved
    w.put<std::uint64_t>(tokens.size());
    w.put<std::uint64_t>(media.size());
    w.put<std::uint64_t>(cells.size());
    w.put_bytes(tokens.data(), tokens.size_bytes());
    for (const media_chunk& m : media) {
        w.put<std::uint64_t>(m.id);
        w.put<std::uint32_t>(m.begin);
        w.put<std::uint32_t>(m.n_pos);
    }
    for (std::uint32_t c : cells) {
        w.put<std::int32_t>(ct.pos(c));
        w.put<std::int32_t>(ct.shift(c));
        if (seq < 0) {
            w.put<std::uint32_t>(static_cast<std::uint32_t>(ct.seqs(c).count()));
            ct.seqs(c).for_each([&](seq_id_t s) { w.put<std::int32_t>(s); });
        } else {
            w.put<std::uint32_t>(1);
            w.put<std::int32_t>(seq);
        }
    }
    if (!pruning.empty()) {
        w.put<std::uint32_t>(static_cast<std::uint32_t>(pruning.size()));
        for (const auto& [s, p] : pruning) {
            w.put<std::int32_t>(s);
            w.put<std::int32_t>(p);
        }
    }
    XXH3_state_t hash;
    XXH3_64bits_reset(&hash);
    XXH3_64bits_update(&hash, out.data(), static_cast<std::size_t>(w.pos() - out.data()));
    const copy_plan plan = make_copy_plan(cells);
    const layer_sizes ls = *sizes_for(f, cells.size());
    for (std::uint32_t l = 0; l < f.n_layer; ++l)
        transfer_layer<true>(cache.storage().view(l), plan, cells, w.take(static_cast<std::size_t>(ls.layer)), &hash);
    w.put<std::uint64_t>(XXH3_64bits_digest(&hash));
    KVCACHE_ASSERT(w.pos() == out.data() + out.size());
}

/// A validated state, ready to be committed.
struct staged_state {
    state_kind kind = state_kind::whole_cache;
    seq_id_t saved_seq = -1;
    std::vector<token_t> tokens;
    std::vector<media_chunk> media;
    std::vector<pos_t> pos;         // per saved cell
    std::vector<std::int32_t> shift;
    std::vector<seq_set> seqs;
    std::vector<std::pair<seq_id_t, pos_t>> pruning;  // (sequence in the cache, pruning point)
    const std::byte* data = nullptr;  // first byte of the K/V section
    std::uint64_t layer_bytes = 0;
};

/// Parses and validates `in` against `cache` without touching it. For kind
/// one_sequence, `dst` is the sequence the cells will belong to.
template <class Cache>
result<staged_state> parse_state(const char* fn, const Cache& cache, std::span<const std::byte> in,
                                 state_kind want, seq_id_t dst, const load_options& opt) {
    const std::string who = std::string(fn) + ": ";
    auto err = [&](errc code, const std::string& msg) -> result<staged_state> { return make_error(code, who + msg); };
    const std::uint64_t size = in.size();
    if (size >= 4 && load_le<std::uint32_t>(in.data()) != state_magic)
        return err(errc::bad_magic, "magic is " + hex(load_le<std::uint32_t>(in.data())) + ", expected " +
                                        hex(state_magic) + " (\"KVST\"): not a kvcache state");
    if (size >= 8) {
        const auto v = load_le<std::uint32_t>(in.data() + off::version);
        if (v > state_version)
            return err(errc::unsupported_version, "format version " + std::to_string(v) +
                                                      " is newer than this library reads (version " +
                                                      std::to_string(state_version) + "); upgrade kvcache");
        if (v < state_version)
            return err(errc::unsupported_version, "format version " + std::to_string(v) +
                                                      " is older than the oldest this library reads (version " +
                                                      std::to_string(state_version) + "); save the state again");
    }
    if (size < state_header_size + state_checksum_size)
        return err(errc::truncated, "state is " + std::to_string(size) + " bytes, shorter than the " +
                                        std::to_string(state_header_size + state_checksum_size) +
                                        "-byte header and checksum");
    const auto total = load_le<std::uint64_t>(in.data() + off::total_size);
    if (total < state_header_size + state_checksum_size || size < total)
        return err(errc::truncated, "state declares " + std::to_string(total) + " bytes, got " + std::to_string(size));
    if (size > total)
        return err(errc::trailing_bytes, "state declares " + std::to_string(total) + " bytes, got " +
                                             std::to_string(size) + " (" + std::to_string(size - total) +
                                             " bytes after its end)");
    const std::uint64_t stored = load_le<std::uint64_t>(in.data() + size - state_checksum_size);
    const std::uint64_t actual = checksum(in.first(static_cast<std::size_t>(size - state_checksum_size)));
    if (stored != actual)
        return err(errc::checksum_mismatch, "stored checksum " + hex(stored) + ", computed " + hex(actual));

    byte_reader r(in.first(static_cast<std::size_t>(size - state_checksum_size)));
    r.take(off::kind);
    const auto kind = r.get<std::uint32_t>();
    const auto flags = r.get<std::uint32_t>();
    if (kind > 1) return err(errc::unsupported, "state kind " + std::to_string(kind) + " unknown (0 or 1)");
    if (kind != static_cast<std::uint32_t>(want))
        return err(errc::unsupported, kind == 0 ? "the bytes hold a whole cache; use load_state"
                                                : "the bytes hold one sequence; use load_seq");
    if ((flags & ~state_flag_pruning) != 0)
        return err(errc::unsupported, "flags = " + hex(flags) + ", version 1 defines only bit 0 (pruning table)");

    const fingerprint f = fingerprint_of(cache);
    const char* names[] = {"n_layer", "n_head_kv",  "head_dim_k",      "head_dim_v",       "element type_id",
                           "element size", "rope type", "rope n_rot", "rope freq_base bits", "rope freq_scale bits",
                           "layout_id",  "window"};
    const std::uint32_t want_f[] = {f.n_layer,  f.n_head_kv, f.head_dim_k,     f.head_dim_v,
                                    f.type_id,  f.elem_size, f.rope_type,      f.n_rot,
                                    f.freq_base_bits, f.freq_scale_bits, f.layout_id, f.window};
    for (int i = 0; i < 12; ++i) {
        const auto got = r.get<std::uint32_t>();
        if (i == 10) continue;                   // layout kind: informational, states load across layouts
        if (i == 11 && (want_f[i] == 0 || got == 0)) continue;  // windows must agree only when both have one
        if (got != want_f[i])
            return err(i == 4 || i == 5 ? errc::dtype_mismatch : errc::shape_mismatch,
                       std::string(names[i]) + " = " + std::to_string(got) + " in the state, the cache has " +
                           std::to_string(want_f[i]));
    }
    staged_state st;
    st.kind = static_cast<state_kind>(kind);
    st.saved_seq = r.get<std::int32_t>();
    const auto reserved = r.get<std::uint32_t>();
    if (reserved != 0) return err(errc::unsupported, "reserved field = " + hex(reserved) + ", must be 0");
    if (st.kind == state_kind::whole_cache ? st.saved_seq != -1 : st.saved_seq < 0)
        return err(errc::invalid_cell, "seq = " + std::to_string(st.saved_seq) +
                                           (st.kind == state_kind::whole_cache ? ", must be -1 for a whole cache"
                                                                               : ", must be >= 0"));
    const auto n_tokens = r.get<std::uint64_t>();
    const auto n_media = r.get<std::uint64_t>();
    const auto n_cells = r.get<std::uint64_t>();

    // Counts: against limits first, then against the bytes present (checked products).
    if (n_tokens > opt.max_tokens)
        return err(errc::no_space, "n_tokens = " + std::to_string(n_tokens) + " exceeds the limit " +
                                       std::to_string(opt.max_tokens) + " (load_options.max_tokens)");
    const auto tok_bytes = mul_u64(n_tokens, 4);
    if (!tok_bytes || !r.has(*tok_bytes))
        return err(errc::truncated, "n_tokens = " + std::to_string(n_tokens) + " needs " +
                                        (tok_bytes ? std::to_string(*tok_bytes) : std::string("more than 2^64")) +
                                        " bytes, " + std::to_string(r.left()) + " left");
    if (n_media > n_tokens)
        return err(errc::invalid_cell, "n_media = " + std::to_string(n_media) + " exceeds n_tokens = " +
                                           std::to_string(n_tokens) + " (each chunk covers a position)");
    const auto media_bytes = mul_u64(n_media, 16);
    if (!media_bytes || !r.has(*tok_bytes + *media_bytes))  // sum <= 5 * n_tokens * 4: no overflow
        return err(errc::truncated, "n_media = " + std::to_string(n_media) + " needs more bytes than the " +
                                        std::to_string(r.left() - *tok_bytes) + " left");
    const cell_table& ct = cache.cells();
    std::uint64_t room = ct.size();
    if (st.kind == state_kind::one_sequence) {  // free cells + cells only dst uses (they are replaced)
        room = ct.free_count();
        for (std::uint32_t c : ct.used_cells())
            if (ct.seqs(c).test(dst) && ct.seqs(c).count() == 1) ++room;
    }
    if (n_cells > room)
        return err(errc::no_space, "n_cells = " + std::to_string(n_cells) + " exceeds " +
                                       (st.kind == state_kind::whole_cache ? "the capacity " : "the free cells ") +
                                       std::to_string(room));
    const auto ls = sizes_for(f, n_cells);
    if (!ls) return err(errc::truncated, "n_cells = " + std::to_string(n_cells) + ": data size overflows 2^64");

    st.tokens.resize(static_cast<std::size_t>(n_tokens));
    if (n_tokens != 0)  // memcpy needs non-null pointers even for 0 bytes
        std::memcpy(st.tokens.data(), r.take(static_cast<std::size_t>(*tok_bytes)), static_cast<std::size_t>(*tok_bytes));
    st.media.resize(static_cast<std::size_t>(n_media));
    for (auto& m : st.media) {
        m.id = r.get<std::uint64_t>();
        m.begin = r.get<std::uint32_t>();
        m.n_pos = r.get<std::uint32_t>();
    }
    if (auto bad = check_tokens(st.tokens, st.media)) return err(errc::invalid_cell, *bad);

    constexpr bool can_shift = Cache::layout::can_shift;
    const auto n = static_cast<std::size_t>(n_cells);
    st.pos.resize(n);
    st.shift.resize(n);
    st.seqs.resize(n);
    const std::uint32_t n_seq_max = cache.shape().n_seq_max;
    for (std::size_t i = 0; i < n; ++i) {
        const std::string cell = "cell " + std::to_string(i);
        if (!r.has(12)) return err(errc::truncated, cell + ": record needs 12 bytes, " + std::to_string(r.left()) + " left");
        st.pos[i] = r.get<std::int32_t>();
        st.shift[i] = r.get<std::int32_t>();
        const auto n_seq = r.get<std::uint32_t>();
        if (st.pos[i] < 0) return err(errc::invalid_cell, cell + ": pos = " + std::to_string(st.pos[i]) + ", must be >= 0");
        const std::int64_t origin = std::int64_t{st.pos[i]} - st.shift[i];
        if (origin < 0 || origin > std::numeric_limits<pos_t>::max())
            return err(errc::invalid_cell, cell + ": pos " + std::to_string(st.pos[i]) + " with shift " +
                                               std::to_string(st.shift[i]) + " puts its K at position " +
                                               std::to_string(origin) + ", outside [0, 2^31)");
        if (!can_shift && st.shift[i] != 0)
            return err(errc::invalid_cell, cell + ": shift = " + std::to_string(st.shift[i]) + " but the " +
                                               std::string(Cache::layout::name) + " layout cannot shift");
        const std::uint32_t max_seq = st.kind == state_kind::whole_cache ? n_seq_max : 1;
        if (n_seq == 0 || n_seq > max_seq)
            return err(errc::invalid_cell, cell + ": holds " + std::to_string(n_seq) + " sequences, must be in [1, " +
                                               std::to_string(max_seq) + "]");
        if (!r.has(std::uint64_t{n_seq} * 4))
            return err(errc::truncated, cell + ": " + std::to_string(n_seq) + " sequence ids need " +
                                            std::to_string(std::uint64_t{n_seq} * 4) + " bytes, " +
                                            std::to_string(r.left()) + " left");
        seq_id_t prev = -1;
        for (std::uint32_t k = 0; k < n_seq; ++k) {
            const auto s = r.get<std::int32_t>();
            if (st.kind == state_kind::one_sequence) {
                if (s != st.saved_seq)
                    return err(errc::invalid_cell, cell + ": sequence " + std::to_string(s) +
                                                       ", a one-sequence state holds only sequence " +
                                                       std::to_string(st.saved_seq));
                st.seqs[i].set(dst);
                continue;
            }
            if (s < 0 || static_cast<std::uint32_t>(s) >= n_seq_max)
                return err(errc::invalid_cell, cell + ": sequence id " + std::to_string(s) + " outside [0, " +
                                                   std::to_string(n_seq_max) + ")");
            if (s <= prev)
                return err(errc::invalid_cell, cell + ": sequence ids not strictly increasing (" +
                                                   std::to_string(prev) + " then " + std::to_string(s) + ")");
            st.seqs[i].set(s);
            prev = s;
        }
    }
    if ((flags & state_flag_pruning) != 0) {
        if (!r.has(4)) return err(errc::truncated, "pruning table: count needs 4 bytes, " + std::to_string(r.left()) + " left");
        const auto n_pruned = r.get<std::uint32_t>();
        const std::uint32_t max_entries = st.kind == state_kind::whole_cache ? n_seq_max : 1;
        if (n_pruned == 0 || n_pruned > max_entries)
            return err(errc::invalid_cell, "pruning table holds " + std::to_string(n_pruned) +
                                               " sequences, must be in [1, " + std::to_string(max_entries) + "]");
        if (!r.has(std::uint64_t{n_pruned} * 8))
            return err(errc::truncated, "pruning table: " + std::to_string(n_pruned) + " entries need " +
                                            std::to_string(std::uint64_t{n_pruned} * 8) + " bytes, " +
                                            std::to_string(r.left()) + " left");
        std::vector<pos_t> top(n_seq_max, -1);  // largest saved position per sequence (in the cache's ids)
        for (std::size_t i = 0; i < n; ++i) st.seqs[i].for_each([&](seq_id_t s) {
            top[static_cast<std::size_t>(s)] = std::max(top[static_cast<std::size_t>(s)], st.pos[i]);
        });
        seq_id_t prev = -1;
        for (std::uint32_t k = 0; k < n_pruned; ++k) {
            const auto s = r.get<std::int32_t>();
            const auto w = r.get<std::int32_t>();
            const std::string entry = "pruning table entry " + std::to_string(k) + ": ";
            if (st.kind == state_kind::one_sequence ? s != st.saved_seq
                                                    : s < 0 || static_cast<std::uint32_t>(s) >= n_seq_max || s <= prev)
                return err(errc::invalid_cell, entry + "sequence " + std::to_string(s) +
                                                   (st.kind == state_kind::one_sequence
                                                        ? ", a one-sequence state holds only sequence " +
                                                              std::to_string(st.saved_seq)
                                                        : " out of [0, " + std::to_string(n_seq_max) +
                                                              ") or not above the previous entry's"));
            prev = s;
            const seq_id_t in_cache = st.kind == state_kind::one_sequence ? dst : s;
            const pos_t last = top[static_cast<std::size_t>(in_cache)];
            if (last < 0) return err(errc::invalid_cell, entry + "sequence " + std::to_string(s) + " holds no cell");
            if (w < 1 || std::int64_t{w} > std::int64_t{last} + 1)
                return err(errc::invalid_cell, entry + "pruned_below = " + std::to_string(w) + ", must be in [1, " +
                                                   std::to_string(std::int64_t{last} + 1) +
                                                   "] (the sequence's largest position + 1)");
            st.pruning.emplace_back(in_cache, w);
        }
    }
    const auto data_bytes = mul_u64(ls->layer, f.n_layer);
    if (!data_bytes || *data_bytes > r.left())
        return err(errc::truncated, "K/V data of " + std::to_string(n_cells) + " cells needs " +
                                        (data_bytes ? std::to_string(*data_bytes) : std::string("more than 2^64")) +
                                        " bytes, " + std::to_string(r.left()) + " left");
    if (*data_bytes < r.left())
        return err(errc::trailing_bytes, std::to_string(r.left() - *data_bytes) +
                                             " bytes between the K/V data and the checksum");
    st.layer_bytes = ls->layer;
    st.data = r.take(static_cast<std::size_t>(*data_bytes));

    // Lanes past n_cells in the last K tile are zero in every state the saver writes.
    constexpr std::uint32_t w = state_k_lanes;
    const std::uint32_t tail = static_cast<std::uint32_t>(n % w);
    if (tail != 0) {
        const std::size_t es = f.elem_size;
        const std::size_t tile_bytes = std::size_t{w} * f.head_dim_k * es;
        for (std::uint32_t l = 0; l < f.n_layer; ++l)
            for (std::uint32_t h = 0; h < f.n_head_kv; ++h) {
                const std::byte* last = st.data + l * ls->layer + h * ls->k_head + ls->k_head - tile_bytes;
                for (std::uint32_t d = 0; d < f.head_dim_k; ++d)
                    for (std::size_t b = (d * std::size_t{w} + tail) * es; b < (d + 1) * std::size_t{w} * es; ++b)
                        if (last[b] != std::byte{0})
                            return err(errc::invalid_cell, "layer " + std::to_string(l) + " head " + std::to_string(h) +
                                                               ": K padding lanes past cell " + std::to_string(n) +
                                                               " are not zero");
            }
    }

    // A layout that cannot move positions never holds one (sequence, position) twice;
    // seq_add / seq_div can legitimately produce duplicates in the others.
    if constexpr (!can_shift) {
        std::vector<std::pair<seq_id_t, pos_t>> pairs;
        for (std::size_t i = 0; i < n; ++i) st.seqs[i].for_each([&](seq_id_t s) { pairs.emplace_back(s, st.pos[i]); });
        std::sort(pairs.begin(), pairs.end());
        const auto dup = std::adjacent_find(pairs.begin(), pairs.end());
        if (dup != pairs.end())
            return err(errc::invalid_cell, "sequence " + std::to_string(dup->first) + " holds position " +
                                               std::to_string(dup->second) + " twice");
    }
    return st;
}

/// Where a staged state goes: moves[i] = {from, to} are cells (with every sequence, K/V and
/// shift) a layout moves out of the way first, then saved cell i goes to cells[i].
struct picked_cells {
    std::vector<std::uint32_t> cells;
    std::vector<std::pair<std::uint32_t, std::uint32_t>> moves;
};

/// Cells a staged state goes to, chosen on the cell table as it is now (after the
/// caller removed what the load replaces). Layouts that place cells themselves decide
/// (storage hook plan_load, which may move other sequences' cells, else plan_place);
/// otherwise the lowest free cells, in order.
template <class Cache>
result<picked_cells> pick_cells(Cache& cache, cell_table& ct, const staged_state& st) {
    auto& storage = cache.storage();
    const std::span<const pos_t> pos(st.pos);
    const std::span<const seq_set> seqs(st.seqs);
    picked_cells out;
    if constexpr (cache_has_capability<Cache, layout_caps::load_plan>()) {
        auto plan = storage.plan_load(ct, pos, seqs);
        if (!plan) return make_error(plan.code(), plan.message());
        out.cells = std::move(plan.value().cells);
        for (const auto& m : plan.value().moves) out.moves.emplace_back(m.from, m.to);
    } else if constexpr (cache_has_capability<Cache, layout_caps::placement_plan>()) {
        auto plan = storage.plan_place(ct, pos, seqs);
        if (!plan) return make_error(plan.code(), plan.message());
        if (!plan.value().copies.empty())
            return make_error(errc::no_space, "the layout wants to copy shared cells to place the state");
        out.cells = std::move(plan.value().cells);
    } else {
        out.cells.reserve(st.pos.size());
        for (std::uint32_t c = 0; out.cells.size() < st.pos.size() && c < ct.size(); ++c)
            if (ct.is_free(c)) out.cells.push_back(c);
        if (out.cells.size() != st.pos.size()) return make_error(errc::no_space, "not enough free cells");
    }
    return out;
}

/// Pruning points of every sequence of a layout that prunes (ring), else empty.
template <class Cache>
std::vector<pos_t> pruning_points(const Cache& cache) {
    std::vector<pos_t> out;
    if constexpr (cache_has_capability<Cache, layout_caps::pruning>())
        for (seq_id_t s = 0; s < static_cast<seq_id_t>(cache.shape().n_seq_max); ++s)
            out.push_back(cache.storage().pruned_below(s));
    return out;
}
/// Sets the pruning point of sequence `only` (every sequence if only < 0) to points[s]
/// (indexed by sequence; 0: none) on a layout that prunes.
template <class Cache>
void set_pruning_points(Cache& cache, const std::vector<pos_t>& points, seq_id_t only) {
    if constexpr (cache_has_capability<Cache, layout_caps::pruning>())
        for (seq_id_t s = 0; s < static_cast<seq_id_t>(cache.shape().n_seq_max); ++s)
            if (only < 0 || s == only) cache.storage().set_pruned_below(s, points[static_cast<std::size_t>(s)]);
}

/// Applies a validated state. Only the layout can still refuse (no free cell it accepts);
/// then the cell metadata and pruning points are put back exactly and no K/V byte was written.
template <class Cache>
result<load_info> commit_state(const char* fn, Cache& cache, staged_state&& st, seq_id_t dst) {
    const std::vector<pos_t> pruned_before = pruning_points(cache);
    cell_table& ct = cache.cells_for_update(internal_access{});
    // Undo log: every cell the load changes before the layout has accepted the placement.
    std::vector<std::pair<std::uint32_t, cell_table::snapshot>> undo;
    if (st.kind == state_kind::whole_cache) {
        for (std::uint32_t c : ct.used_cells()) undo.emplace_back(c, ct.save(c));
        ct.clear();
    } else {
        std::vector<std::uint32_t> old;
        for (std::uint32_t c : ct.used_cells())
            if (ct.seqs(c).test(dst)) old.push_back(c);
        for (std::uint32_t c : old) {
            undo.emplace_back(c, ct.save(c));
            ct.rm_seq(c, dst);
        }
    }
    auto picked = pick_cells(cache, ct, st);
    if (!picked) {
        if (st.kind == state_kind::whole_cache) ct.clear();
        for (const auto& [c, snap] : undo) ct.load(c, snap);
        set_pruning_points(cache, pruned_before, -1);
        return make_error(picked.code(), std::string(fn) + ": " + picked.message());
    }
    for (const auto& [from, to] : picked.value().moves) {  // the layout makes room: move whole cells
        cache.storage().copy_cell(from, to);
        ct.occupy(to, ct.pos(from), ct.seqs(from));
        ct.set_shift(to, ct.shift(from));
        ct.free_cell(from);
    }
    load_info info;
    info.cells = std::move(picked.value().cells);
    for (std::size_t i = 0; i < info.cells.size(); ++i) {
        ct.occupy(info.cells[i], st.pos[i], st.seqs[i]);
        ct.set_shift(info.cells[i], st.shift[i]);
    }
    std::vector<pos_t> pruned_after(cache.shape().n_seq_max, 0);
    for (const auto& [s, w] : st.pruning) pruned_after[static_cast<std::size_t>(s)] = w;
    set_pruning_points(cache, pruned_after, st.kind == state_kind::whole_cache ? -1 : dst);
    if (st.kind == state_kind::whole_cache) cache.reset_head(internal_access{});
    const copy_plan plan = make_copy_plan(info.cells);
    for (std::uint32_t l = 0; l < cache.shape().n_layer; ++l)
        transfer_layer<false>(cache.storage().view(l), plan, info.cells, st.data + l * st.layer_bytes, nullptr);
    info.kind = st.kind;
    info.saved_seq = st.saved_seq;
    info.tokens = std::move(st.tokens);
    info.media = std::move(st.media);
    return info;
}

}  // namespace detail

// ---------------------------------------------------------------------- saving

/// Bytes save_state() produces for this cache and prompt.
template <class Cache>
[[nodiscard]] std::size_t state_size(const Cache& cache, std::span<const token_t> tokens = {},
                                     std::span<const media_chunk> media = {}) {
    const auto cells = detail::cells_to_save(cache, -1);
    return detail::state_bytes(cache, cells, -1, tokens.size(), media.size());
}

/// Bytes save_seq() produces for sequence `seq` and this prompt.
template <class Cache>
[[nodiscard]] std::size_t seq_state_size(const Cache& cache, seq_id_t seq, std::span<const token_t> tokens = {},
                                         std::span<const media_chunk> media = {}) {
    detail::check_save_args("seq_state_size", cache, true, seq, tokens, media);
    const auto cells = detail::cells_to_save(cache, seq);
    return detail::state_bytes(cache, cells, seq, tokens.size(), media.size());
}

/// Serialises the whole cache (every used cell: position, pending shift, sequences,
/// K/V of every layer) plus an optional prompt (tokens with media chunks) into `out`,
/// which must hold exactly state_size() bytes. Reusing one buffer avoids page faults.
template <class Cache>
void save_state_into(const Cache& cache, std::span<std::byte> out, std::span<const token_t> tokens = {},
                     std::span<const media_chunk> media = {}) {
    detail::require_raw_view<Cache>();
    detail::check_save_args("save_state", cache, false, -1, tokens, media);
    const auto cells = detail::cells_to_save(cache, -1);
    const std::size_t need = detail::state_bytes(cache, cells, -1, tokens.size(), media.size());
    if (out.size() != need)
        kvcache::detail::fail(errc::invalid_argument, "save_state_into: out has " + std::to_string(out.size()) +
                                                          " bytes, the state needs " + std::to_string(need));
    detail::write_state(cache, cells, -1, tokens, media, out);
}

/// Serialises the whole cache; see save_state_into.
template <class Cache>
[[nodiscard]] std::vector<std::byte> save_state(const Cache& cache, std::span<const token_t> tokens = {},
                                                std::span<const media_chunk> media = {}) {
    std::vector<std::byte> out(state_size(cache, tokens, media));
    save_state_into(cache, std::span<std::byte>(out), tokens, media);
    return out;
}

/// Serialises one sequence (its cells in cell order, each saved as used by `seq` only)
/// plus an optional prompt into `out`, which must hold exactly seq_state_size() bytes.
template <class Cache>
void save_seq_into(const Cache& cache, seq_id_t seq, std::span<std::byte> out, std::span<const token_t> tokens = {},
                   std::span<const media_chunk> media = {}) {
    detail::require_raw_view<Cache>();
    detail::check_save_args("save_seq", cache, true, seq, tokens, media);
    const auto cells = detail::cells_to_save(cache, seq);
    const std::size_t need = detail::state_bytes(cache, cells, seq, tokens.size(), media.size());
    if (out.size() != need)
        kvcache::detail::fail(errc::invalid_argument, "save_seq_into: out has " + std::to_string(out.size()) +
                                                          " bytes, the state needs " + std::to_string(need));
    detail::write_state(cache, cells, seq, tokens, media, out);
}

/// Serialises one sequence; see save_seq_into.
template <class Cache>
[[nodiscard]] std::vector<std::byte> save_seq(const Cache& cache, seq_id_t seq, std::span<const token_t> tokens = {},
                                              std::span<const media_chunk> media = {}) {
    std::vector<std::byte> out(seq_state_size(cache, seq, tokens, media));
    save_seq_into(cache, seq, std::span<std::byte>(out), tokens, media);
    return out;
}

// --------------------------------------------------------------------- loading

/// Replaces the whole cache by the state in `bytes` (saved by save_state from a cache
/// with the same model shape and element type, any layout). Cells are renumbered from
/// the layout's first free cell. On error the cache is unchanged and the result names
/// the problem: bad_magic, unsupported_version, truncated, trailing_bytes,
/// checksum_mismatch, shape_mismatch, dtype_mismatch, no_space, invalid_cell, unsupported.
/// Throws kvcache::error(transaction_open) if placements are staged.
template <class Cache>
[[nodiscard]] result<load_info> load_state(Cache& cache, std::span<const std::byte> bytes,
                                           const load_options& opt = {}) {
    detail::require_raw_view<Cache>();
    if (cache.in_transaction())
        kvcache::detail::fail(errc::transaction_open, "load_state: placements are staged; commit() or restore() first");
    auto st = detail::parse_state("load_state", cache, bytes, state_kind::whole_cache, -1, opt);
    if (!st) return detail::make_error(st.code(), st.message());
    return detail::commit_state("load_state", cache, std::move(st.value()), -1);
}

/// Loads one sequence saved by save_seq into sequence `dst`, replacing what dst held;
/// other sequences are untouched. Errors as for load_state (the cache is unchanged).
/// Throws kvcache::error for dst outside [0, n_seq_max) or staged placements.
template <class Cache>
[[nodiscard]] result<load_info> load_seq(Cache& cache, seq_id_t dst, std::span<const std::byte> bytes,
                                         const load_options& opt = {}) {
    detail::require_raw_view<Cache>();
    if (cache.in_transaction())
        kvcache::detail::fail(errc::transaction_open, "load_seq: placements are staged; commit() or restore() first");
    if (dst < 0 || static_cast<std::uint32_t>(dst) >= cache.shape().n_seq_max)
        kvcache::detail::fail(errc::invalid_argument, "load_seq: dst = " + std::to_string(dst) + ", must be in [0, " +
                                                          std::to_string(cache.shape().n_seq_max) + ")");
    auto st = detail::parse_state("load_seq", cache, bytes, state_kind::one_sequence, dst, opt);
    if (!st) return detail::make_error(st.code(), st.message());
    return detail::commit_state("load_seq", cache, std::move(st.value()), dst);
}

// ----------------------------------------------------------------------- files

/// Saves the whole cache to a session file (temporary file + rename: never a
/// truncated file under `path`). errc::io_error names the path and the reason.
template <class Cache>
[[nodiscard]] result<void> save_file(const Cache& cache, const std::filesystem::path& path,
                                     std::span<const token_t> tokens = {}, std::span<const media_chunk> media = {}) {
    return write_file_atomic(path, save_state(cache, tokens, media));
}

/// Saves one sequence to a session file (see save_file).
template <class Cache>
[[nodiscard]] result<void> save_seq_file(const Cache& cache, seq_id_t seq, const std::filesystem::path& path,
                                         std::span<const token_t> tokens = {}, std::span<const media_chunk> media = {}) {
    return write_file_atomic(path, save_seq(cache, seq, tokens, media));
}

/// Loads a session file written by save_file (see load_state); a missing,
/// unreadable or non-regular path gives errc::io_error. The cache is unchanged on error.
template <class Cache>
[[nodiscard]] result<load_info> load_file(Cache& cache, const std::filesystem::path& path,
                                          const load_options& opt = {}) {
    auto bytes = read_file(path);
    if (!bytes) return detail::make_error(bytes.code(), "load_file: " + bytes.message());
    return load_state(cache, std::span<const std::byte>(bytes.value()), opt);
}

/// Loads a session file written by save_seq_file into sequence dst (see load_seq).
template <class Cache>
[[nodiscard]] result<load_info> load_seq_file(Cache& cache, seq_id_t dst, const std::filesystem::path& path,
                                              const load_options& opt = {}) {
    auto bytes = read_file(path);
    if (!bytes) return detail::make_error(bytes.code(), "load_seq_file: " + bytes.message());
    return load_seq(cache, dst, std::span<const std::byte>(bytes.value()), opt);
}

}  // namespace io
KVCACHE_END_NAMESPACE
