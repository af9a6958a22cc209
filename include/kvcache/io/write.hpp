// kvcache io: writing a state (format.hpp) from a cache: which cells, how many bytes,
// and the bytes themselves.
#pragma once

#include <cstddef>  // std::byte, std::size_t
#include <cstdint>  // fixed-width integers
#include <span>     // inputs and outputs
#include <string>   // messages
#include <utility>  // std::pair
#include <vector>   // cell lists

#include "../cells/cell_table.hpp"
#include "../detail/policy_select.hpp"
#include "../error.hpp"
#include "../layout/capabilities.hpp"
#include "../tokens/token.hpp"
#include "detail/xxhash.hpp"
#include "fingerprint.hpp"
#include "header.hpp"
#include "format.hpp"
#include "transfer.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace io {

namespace detail {

using kvcache::detail::internal_access;
using kvcache::detail::make_error;

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
    if (cache.shape().rope.mrope.on()) n += cells.size() * 12;  // M-RoPE positions
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
    state_header h;
    h.kind = static_cast<std::uint32_t>(seq < 0 ? state_kind::whole_cache : state_kind::one_sequence);
    const bool mrope = cache.shape().rope.mrope.on();
    h.flags = (pruning.empty() ? 0u : state_flag_pruning) | (mrope ? state_flag_mrope : 0u);
    h.fp = f;
    h.seq = seq < 0 ? -1 : seq;
    h.rope_ext = f.rope_ext;
    h.n_tokens = tokens.size();
    h.n_media = media.size();
    h.n_cells = cells.size();
    write_header(w, h);
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
    if (mrope)
        for (std::uint32_t c : cells) {
            const mrope_pos e = ct.ext(c);
            w.put<std::int32_t>(e.h);
            w.put<std::int32_t>(e.w);
            w.put<std::int32_t>(e.e);
        }
    if (!pruning.empty()) {
        w.put<std::uint32_t>(static_cast<std::uint32_t>(pruning.size()));
        for (const auto& [s, p] : pruning) {
            w.put<std::int32_t>(s);
            w.put<std::int32_t>(p);
        }
    }
    hasher hash;
    hash.update(out.data(), static_cast<std::size_t>(w.pos() - out.data()));
    const copy_plan plan = make_copy_plan(cells);
    const layer_sizes ls = *sizes_for(f, cells.size());
    for (std::uint32_t l = 0; l < f.n_layer; ++l)
        transfer_layer<true>(cache.storage().view(l), plan, cells, w.take(static_cast<std::size_t>(ls.layer)), &hash);
    w.put<std::uint64_t>(hash.digest());
    KVCACHE_ASSERT(w.pos() == out.data() + out.size());
}

}  // namespace detail

}  // namespace io
KVCACHE_END_NAMESPACE
