// kvcache io: applying a parsed state (parse.hpp) to a cache: choosing its cells through
// the layout's hooks (plan_load, plan_place), restoring pruning points, writing K/V.
#pragma once

#include <cstdint>  // fixed-width integers
#include <span>     // positions and sequences
#include <string>   // messages
#include <utility>  // std::pair, std::move
#include <vector>   // undo log

#include "../cells/cell_table.hpp"
#include "../detail/policy_select.hpp"
#include "../cells/rollback.hpp"
#include "../error.hpp"
#include "../layout/capabilities.hpp"
#include "parse.hpp"
#include "transfer.hpp"
#include "types.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace io {

namespace detail {

using kvcache::detail::internal_access;
using kvcache::detail::make_error;

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

/// A state whose cells are chosen (commit phase 1): the cell table already holds what the
/// load keeps (the replaced cells removed), `undo` and `pruned_before` put it back.
struct prepared_commit {
    std::vector<std::pair<std::uint32_t, cell_table::snapshot>> undo;
    std::vector<pos_t> pruned_before;
    picked_cells picked;
};

/// Puts the cell metadata and pruning points back as before prepare_commit (the undo of
/// phase 1; no K/V byte was written yet).
template <class Cache>
void rollback_commit(Cache& cache, const staged_state& st, const prepared_commit& pc) {
    cell_table& ct = cache.cells_for_update(internal_access{});
    if (st.kind == state_kind::whole_cache) ct.clear();
    for (const auto& [c, snap] : pc.undo) ct.load(c, snap);
    set_pruning_points(cache, pc.pruned_before, -1);
}

/// Commit phase 1: removes what the load replaces and lets the layout choose the cells.
/// Only the layout can refuse (no free cell it accepts); then the cell metadata and
/// pruning points are put back exactly and no K/V byte was written.
template <class Cache>
result<prepared_commit> prepare_commit(const char* fn, Cache& cache, const staged_state& st, seq_id_t dst) {
    prepared_commit pc;
    pc.pruned_before = pruning_points(cache);
    cell_table& ct = cache.cells_for_update(internal_access{});
    // Undo log: every cell the load changes before the layout has accepted the placement.
    if (st.kind == state_kind::whole_cache) {
        for (std::uint32_t c : ct.used_cells()) pc.undo.emplace_back(c, ct.save(c));
        ct.clear();
    } else {
        std::vector<std::uint32_t> old;
        for (std::uint32_t c : ct.used_cells())
            if (ct.seqs(c).test(dst)) old.push_back(c);
        for (std::uint32_t c : old) {
            pc.undo.emplace_back(c, ct.save(c));
            ct.rm_seq(c, dst);
        }
    }
    auto picked = pick_cells(cache, ct, st);
    if (!picked) {
        rollback_commit(cache, st, pc);
        return make_error(picked.code(), std::string(fn) + ": " + picked.message());
    }
    pc.picked = std::move(picked.value());
    // A compound operation's byte guard (kv_cache::begin_guard) keeps what the cells the
    // load writes held when it began (the caller's rollback undoes a throw here).
    if constexpr (requires { cache.guard_cells(std::span<const std::uint32_t>{}, internal_access{}); }) {
        cache.guard_cells(std::span<const std::uint32_t>(pc.picked.cells), internal_access{});
        for (const auto& m : pc.picked.moves) cache.guard_cells(std::span<const std::uint32_t>(&m.second, 1), internal_access{});
    }
    return pc;
}

/// The K/V bytes of a committed state (after finish_commit_meta of every part) by `plan`
/// (make_copy_plan(info.cells)): never throws, so with every part's plan built first every
/// step that can throw precedes the first byte (io/state.hpp, load_composite).
template <class Cache>
void write_state_kv(Cache& cache, const staged_state& st, const load_info& info, const copy_plan& plan) {
    for (std::uint32_t l = 0; l < cache.shape().n_layer; ++l)
        transfer_layer<false>(cache.storage().view(l), plan, info.cells, st.data + l * st.layer_bytes, nullptr);
}
/// The same, planning the copy first (the plan allocates; the writes after it do not).
template <class Cache>
void write_state_kv(Cache& cache, const staged_state& st, const load_info& info) {
    write_state_kv(cache, st, info, make_copy_plan(info.cells));
}

/// Commit phase 2 without the K/V bytes (write_state_kv writes them).
template <class Cache>
load_info finish_commit_meta(Cache& cache, staged_state& st, seq_id_t dst, prepared_commit&& pc) {
    cell_table& ct = cache.cells_for_update(internal_access{});
    for (const auto& [from, to] : pc.picked.moves) {  // the layout makes room: move whole cells
        cache.storage().copy_cell(from, to);
        ct.occupy(to, ct.pos(from), ct.seqs(from), ct.ext(from));
        ct.set_shift(to, ct.shift(from));
        ct.free_cell(from);
    }
    load_info info;
    info.cells = std::move(pc.picked.cells);
    for (std::size_t i = 0; i < info.cells.size(); ++i) {
        ct.occupy(info.cells[i], st.pos[i], st.seqs[i], st.ext.empty() ? mrope_pos{} : st.ext[i]);
        ct.set_shift(info.cells[i], st.shift[i]);
    }
    std::vector<pos_t> pruned_after(cache.shape().n_seq_max, 0);
    for (const auto& [s, w] : st.pruning) pruned_after[static_cast<std::size_t>(s)] = w;
    set_pruning_points(cache, pruned_after, st.kind == state_kind::whole_cache ? -1 : dst);
    if (st.kind == state_kind::whole_cache) cache.reset_head(internal_access{});
    info.kind = st.kind;
    info.saved_seq = st.saved_seq;
    info.tokens = std::move(st.tokens);
    info.media = std::move(st.media);
    return info;
}

/// Commit phase 2, which cannot refuse: moves the cells the layout makes room with, writes
/// the metadata, pruning points and K/V of the staged state.
template <class Cache>
load_info finish_commit(Cache& cache, staged_state&& st, seq_id_t dst, prepared_commit&& pc) {
    load_info info = finish_commit_meta(cache, st, dst, std::move(pc));
    write_state_kv(cache, st, info);
    return info;
}

/// Applies a validated state (both phases). Only the layout can still refuse (no free cell
/// it accepts); then the cell metadata and pruning points are put back exactly and no K/V
/// byte was written.
/// Strong guarantee also when an allocation throws: the cache is checkpointed first and
/// put back (K/V bytes are written last, after every step that can throw).
template <class Cache>
result<load_info> commit_state(const char* fn, Cache& cache, staged_state&& st, seq_id_t dst) {
    return kvcache::detail::with_rollback(cache, [&]() -> result<load_info> {
        auto pc = prepare_commit(fn, cache, st, dst);
        if (!pc) return make_error(pc.code(), pc.message());
        return finish_commit(cache, std::move(st), dst, std::move(pc.value()));
    });
}

}  // namespace detail

}  // namespace io
KVCACHE_END_NAMESPACE
