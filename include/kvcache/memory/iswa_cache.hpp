// kvcache: one cache for a model that mixes full-attention and sliding-window layers
// (ISWA, F10), e.g. Gemma-style models where every 6th layer is full attention.
//
// iswa_cache<Window, Policies...> holds two caches behind one interface:
//   - full(): kv_cache<Policies...> for the full-attention layers (any layout);
//   - swa():  kv_cache<element, ring<Window>> for the sliding-window layers.
// Model layer l maps to layer local_layer(l) of the cache its type selects.
//
// Atomicity: placement, commit/restore and sequence operations apply to both caches
// or to neither. place() validates the arguments, dry-runs the ring placement (it has
// no side effects), then places in the full cache (which may still refuse) and
// finally in the ring, which then cannot fail. Sequence operations first check what
// the ring would refuse (positions its window pruned, see ring.hpp; for seq_add /
// seq_div also the free cells it needs to split shared cells) without changing it,
// then run on the full cache (which may still refuse: a position dst already holds,
// no free cell for a split, positions past 2^31-1), and finally on the ring, which
// then cannot refuse: a refusal leaves both caches unchanged. As on kv_cache, the
// sequence operations return result<void>: no room (no_space) and positions the ring
// pruned (unsupported) are error results; invalid arguments and calls while
// placements are staged throw.
//
// seq_add / seq_div record a pending K-shift in both caches: ops::apply_k_shift(iswa)
// rotates the cached K of every layer of both. iswa_cache is a kvcache::composite_memory:
// ops and io reach its two caches through for_each_part. Every entry point takes it:
// ops::attention (per part), ops::apply_k_shift, ops::context_shift, ops::self_extend,
// ops::memory, io::save_state / load_state / save_seq / load_seq / save_file / load_file
// (io/composite.hpp: both parts or neither), slot_manager (SWA checkpoints from `window`).
#pragma once

#include <algorithm>  // std::max
#include <cstdint>  // fixed-width integers
#include <limits>   // position limits
#include <optional> // swa_rope
#include <span>     // batch inputs
#include <string>   // messages
#include <utility>  // std::pair
#include <vector>   // layer map

#include "../error.hpp"
#include "kv_cache.hpp"
#include "../layout/ring.hpp"
#include "../reuse/plan.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Shape of an ISWA cache.
struct iswa_shape {
    model_shape shape;              ///< all layers of the model; n_cells = capacity of the full cache
    std::vector<bool> swa_layers;   ///< per model layer: true = sliding window (size shape.n_layer)
    std::uint32_t swa_n_cells = 0;  ///< capacity of the ring cache (see ring<Window>::cells_for)
    /// RoPE of the sliding-window layers when it differs from shape.rope (which the full
    /// layers use); nullopt: shape.rope for every layer. Gemma 3: shape.rope = base 1e6 with
    /// linear scaling 8 (freq_scale 0.125) for the global layers, swa_rope = base 10000 for
    /// the local ones. Each part's K-shift rotates with its own parameters, and each part's
    /// state fingerprint carries them. Validated like shape.rope (errors name iswa_shape.swa_rope).
    std::optional<rope_params> swa_rope;

    /// Gemma-style pattern: layer l is full attention when (l + 1) % period == 0, else SWA.
    [[nodiscard]] static std::vector<bool> every_nth_full(std::uint32_t n_layer, std::uint32_t period) {
        if (period == 0) detail::fail(errc::invalid_config, "iswa_shape::every_nth_full: period = 0, must be >= 1");
        std::vector<bool> v(n_layer);
        for (std::uint32_t l = 0; l < n_layer; ++l) v[l] = (l + 1) % period != 0;
        return v;
    }
};

/// Where one micro-batch went in each cache.
struct iswa_placement {
    placement full;
    placement swa;
};

/// ISWA cache: full-attention layers in kv_cache<Policies...>, sliding-window layers in
/// a ring<Window> cache of the same element type (see the file comment).
/// Thread safety: as basic_kv_cache (concurrent const calls safe, mutation exclusive).
template <std::uint32_t Window, class... Policies>
class iswa_cache {
public:
    using memory_concept = memory_tag;  // opts in to kvcache::memory (memory.hpp)
    using placement_type = iswa_placement;
    using full_cache = kv_cache<Policies...>;
    using element = typename full_cache::element;
    using swa_cache = kv_cache<element, ring<Window>>;
    /// The reuse policy slots apply (the full cache's; slot_manager takes SWA checkpoints
    /// from `window` for the ring part).
    using reuse = typename full_cache::reuse;
    using swa_storage = typename swa_cache::storage_t;
    static constexpr std::uint32_t window = Window;
    /// Names this composite kind in state files (io/composite.hpp).
    static constexpr std::uint32_t composite_id = 1;
    /// Positions may move when both caches' layouts allow it.
    static constexpr bool can_shift = full_cache::can_shift && swa_cache::can_shift;

    /// Throws kvcache::error(invalid_config) naming a bad parameter.
    explicit iswa_cache(const iswa_shape& s)
        : map_(layer_map(s)), full_(group_shape(s, false)), swa_(group_shape(s, true)), n_layer_(s.shape.n_layer) {}

    /// The full-attention cache (for attention over full layers, state I/O, queries).
    [[nodiscard]] const full_cache& full() const noexcept { return full_; }
    /// The sliding-window cache (attention over SWA layers with window = Window).
    [[nodiscard]] const swa_cache& swa() const noexcept { return swa_; }
    [[nodiscard]] std::uint32_t n_layer() const noexcept { return n_layer_; }
    [[nodiscard]] std::uint32_t n_seq_max() const noexcept { return full_.n_seq_max(); }
    /// Calls f(full()) then f(swa()) (kvcache::composite_memory).
    template <class F>
    void for_each_part(F&& f) const {
        f(full_);
        f(swa_);
    }
    /// Mutable parts, for library operations (ops::apply_k_shift, io) that keep both
    /// caches consistent themselves. Not for host code.
    template <class F>
    void for_each_part(detail::internal_access, F&& f) {
        f(full_);
        f(swa_);
    }
    /// Whether model layer l is a sliding-window layer.
    [[nodiscard]] bool is_swa(std::uint32_t l) const { return map_.at(check_layer("is_swa", l)).first; }
    /// RoPE parameters of model layer l (its part's: iswa_shape::swa_rope or shape.rope); rotate
    /// the layer's q and k with them (ops::rope_rows).
    [[nodiscard]] const rope_params& rope(std::uint32_t l) const {
        return is_swa(l) ? swa_.shape().rope : full_.shape().rope;
    }
    /// Index of model layer l inside the cache of its type.
    [[nodiscard]] std::uint32_t local_layer(std::uint32_t l) const { return map_.at(check_layer("local_layer", l)).second; }

    /// Sequence extent: the full cache holds every position the ring holds and more.
    [[nodiscard]] pos_t seq_pos_min(seq_id_t s) const { return full_.seq_pos_min(s); }
    [[nodiscard]] pos_t seq_pos_max(seq_id_t s) const { return full_.seq_pos_max(s); }
    /// Generation of sequence s over both caches (see basic_kv_cache::seq_generation): the
    /// larger of the two, so any change in either gives a value never returned before.
    [[nodiscard]] std::uint64_t seq_generation(seq_id_t s) const {
        return std::max(full_.seq_generation(s), swa_.seq_generation(s));
    }
    [[nodiscard]] bool in_transaction() const noexcept { return full_.in_transaction(); }
    /// Smallest position of s the sliding-window part still holds (-1: none): where a
    /// prefix can be re-entered without a checkpoint (slot_manager, F23).
    [[nodiscard]] pos_t window_pos_min(seq_id_t s) const { return swa_.seq_pos_min(s); }
    /// Bytes of both caches' buffers.
    [[nodiscard]] std::size_t total_bytes() const noexcept { return full_.total_bytes() + swa_.total_bytes(); }

    /// Places a micro-batch in both caches or in neither (see the file comment).
    [[nodiscard]] result<iswa_placement> place(std::span<const pos_t> pos, std::span<const seq_id_t> seq) {
        if (pos.size() != seq.size())
            detail::fail(errc::invalid_argument, "place: pos has " + std::to_string(pos.size()) +
                                                     " entries but seq has " + std::to_string(seq.size()));
        std::vector<seq_set> sets(seq.size());
        for (std::size_t i = 0; i < seq.size(); ++i) {
            if (seq[i] < 0 || static_cast<std::uint32_t>(seq[i]) >= full_.shape().n_seq_max)
                detail::fail(errc::invalid_argument, "place: seq[" + std::to_string(i) + "] = " +
                                                         std::to_string(seq[i]) + ", must be in [0, " +
                                                         std::to_string(full_.shape().n_seq_max) + ")");
            sets[i] = seq_set::of(seq[i]);
        }
        return place(pos, std::span<const seq_set>(sets));
    }
    /// Places tokens that may belong to several sequences each.
    [[nodiscard]] result<iswa_placement> place(std::span<const pos_t> pos, std::span<const seq_set> seqs) {
        if (pos.size() != seqs.size())
            detail::fail(errc::invalid_argument, "place: pos has " + std::to_string(pos.size()) +
                                                     " entries but seqs has " + std::to_string(seqs.size()));
        for (std::size_t i = 0; i < seqs.size(); ++i) {
            if (seqs[i].none())
                detail::fail(errc::invalid_argument, "place: token " + std::to_string(i) + " has no sequence");
            seqs[i].for_each([&](seq_id_t s) {
                if (static_cast<std::uint32_t>(s) >= full_.shape().n_seq_max)
                    detail::fail(errc::invalid_argument, "place: sequence " + std::to_string(s) + " of token " +
                                                             std::to_string(i) + " is out of range");
            });
            if (pos[i] < 0)
                detail::fail(errc::invalid_argument,
                             "place: pos[" + std::to_string(i) + "] = " + std::to_string(pos[i]) + ", must be >= 0");
        }
        if (pos.size() > swa_.capacity() - swa_.used())
            return detail::make_error(errc::no_space, "place: the sliding-window cache has " +
                                                          std::to_string(swa_.capacity() - swa_.used()) +
                                                          " free cells for a batch of " + std::to_string(pos.size()));
        if constexpr (has_capability<swa_storage, layout_caps::placement_plan>) {
            auto dry = swa_.storage().plan_place(swa_.cells(), pos, seqs);  // no side effects
            if (!dry) return detail::make_error(dry.code(), dry.message());
        }
        typename full_cache::checkpoint cp;  // undoes the full cache's part if the ring throws
        full_.save_checkpoint(cp, detail::internal_access{});
        const std::size_t staged = full_.staged_count(detail::internal_access{});
        auto f = full_.place(pos, seqs);
        if (!f) return detail::make_error(f.code(), f.message());
        try {
            auto w = swa_.place(pos, seqs);
            if (!w) {  // not reached after the dry run; kept for safety
                auto err = detail::make_error(w.code(), w.message());  // may throw: undone once, below
                full_.undo_place(cp, staged, detail::internal_access{});
                return err;
            }
            return iswa_placement{std::move(f.value()), std::move(w.value())};
        } catch (...) {
            full_.undo_place(cp, staged, detail::internal_access{});
            throw;
        }
    }

    /// Writes K rows of model layer l for the placed tokens (n_head_kv x head_dim_k values
    /// each: float, half or bfloat16, as kv_cache::write_k).
    template <kv_row_value R>
    void write_k(std::uint32_t l, const iswa_placement& p, const R* rows) { write("write_k", l, p, rows, false); }
    /// Writes V rows of model layer l for the placed tokens.
    template <kv_row_value R>
    void write_v(std::uint32_t l, const iswa_placement& p, const R* rows) { write("write_v", l, p, rows, true); }
    /// Float rows (also taking nullptr).
    void write_k(std::uint32_t l, const iswa_placement& p, const float* rows) { write("write_k", l, p, rows, false); }
    void write_v(std::uint32_t l, const iswa_placement& p, const float* rows) { write("write_v", l, p, rows, true); }

    /// Commits both caches (the ring prunes what left the window).
    /// A std::bad_alloc from the ring's pruning leaves both caches as before the call
    /// (transaction still open).
    tx_result commit() {
        static_cast<void>(swa_.commit());  // the only part that can throw: first
        return full_.commit();
    }
    /// Restores both caches. Never throws.
    tx_result restore() noexcept {
        static_cast<void>(swa_.restore());
        return full_.restore();
    }

    /// Both caches' checkpoints (cells/rollback.hpp), for compound operations.
    struct checkpoint {
        typename full_cache::checkpoint full;
        typename swa_cache::checkpoint swa;
    };
    void save_checkpoint(checkpoint& cp, detail::internal_access a) const {
        full_.save_checkpoint(cp.full, a);
        swa_.save_checkpoint(cp.swa, a);
    }
    void load_checkpoint(checkpoint& cp, detail::internal_access a) noexcept {
        full_.load_checkpoint(cp.full, a);
        swa_.load_checkpoint(cp.swa, a);
    }
    /// The journal of a compound operation (kv_cache::journal_mark).
    using journal_mark = checkpoint;
    void save_journal(journal_mark& m, detail::internal_access a) const { save_checkpoint(m, a); }
    void load_journal(journal_mark& m, detail::internal_access a) noexcept { load_checkpoint(m, a); }
    /// Both caches' byte guards (kv_cache::begin_guard).
    void begin_guard(const checkpoint& cp, detail::internal_access a) {
        full_.begin_guard(cp.full, a);
        try {
            swa_.begin_guard(cp.swa, a);
        } catch (...) {
            full_.end_guard(a);
            throw;
        }
    }
    void end_guard(detail::internal_access a) noexcept {
        full_.end_guard(a);
        swa_.end_guard(a);
    }
    void rollback_guard(detail::internal_access a) noexcept {
        full_.rollback_guard(a);
        swa_.rollback_guard(a);
    }

    /// seq_rm on both caches or neither. Error result: unsupported (positions the ring pruned).
    [[nodiscard]] result<void> seq_rm(seq_id_t s, pos_t p0, pos_t p1) {
        // The ring may refuse (positions pruned by the window) or throw (arguments): nothing changed.
        return detail::with_rollback(*this, [&]() -> result<void> {
            if (result<void> r = swa_.seq_rm(s, p0, p1); !r) return r;
            return full_.seq_rm(s, p0, p1);
        });
    }
    /// seq_cp on both caches or neither. Error result: unsupported (positions the ring pruned).
    [[nodiscard]] result<void> seq_cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) {
        if (valid_seq(src) && valid_seq(dst) && src != dst && !full_.in_transaction())
            if (const auto r = normalized(p0, p1); r.first <= r.second)
                if constexpr (has_capability<swa_storage, layout_caps::seq_cp_check>)
                    if (result<void> ok = swa_.storage().check_seq_cp(swa_.cells(), src, dst, r.first, r.second);
                        !ok)
                        return ok;  // pruned positions
        // The full cache may still refuse (dst holds a position: throws; its layout): the ring holds a subset.
        return detail::with_rollback(*this, [&]() -> result<void> {
            if (result<void> r = full_.seq_cp(src, dst, p0, p1); !r) return r;
            return swa_.seq_cp(src, dst, p0, p1);  // checked above: refuses nothing
        });
    }
    void seq_keep(seq_id_t s) {
        static_cast<void>(detail::with_rollback(*this, [&]() -> result<void> {
            full_.seq_keep(s);
            swa_.seq_keep(s);
            return {};
        }));
    }
    /// Adds delta to the positions of s (every sequence if s < 0) in [p0, p1) in both caches,
    /// or in neither (see the file comment; the ring's rules are in ring.hpp).
    /// Error results: no_space (no free cell to split a shared cell in either cache),
    /// unsupported (positions the ring pruned).
    [[nodiscard]] result<void> seq_add(seq_id_t s, pos_t p0, pos_t p1, pos_t delta) {
        if (delta != 0)
            if (result<void> r = check_ring_move("seq_add", s, p0, p1, position_move{position_move::op::add, delta});
                !r)
                return r;
        return detail::with_rollback(*this, [&]() -> result<void> {
            if (result<void> r = full_.seq_add(s, p0, p1, delta); !r) return r;
            return swa_.seq_add(s, p0, p1, delta);  // checked above: refuses nothing
        });
    }
    /// Integer-divides the positions of s in [p0, p1) by d > 0 in both caches, or in neither
    /// (error results as seq_add).
    [[nodiscard]] result<void> seq_div(seq_id_t s, pos_t p0, pos_t p1, int d) {
        if (d > 1)
            if (result<void> r = check_ring_move("seq_div", s, p0, p1, position_move{position_move::op::div, d}); !r)
                return r;
        return detail::with_rollback(*this, [&]() -> result<void> {
            if (result<void> r = full_.seq_div(s, p0, p1, d); !r) return r;
            return swa_.seq_div(s, p0, p1, d);  // checked above: refuses nothing
        });
    }
    /// Whether either cache has a pending K-shift.
    [[nodiscard]] bool has_shift() const noexcept { return full_.has_shift() || swa_.has_shift(); }
    void clear() {
        static_cast<void>(detail::with_rollback(*this, [&]() -> result<void> {
            full_.clear();
            swa_.clear();
            return {};
        }));
    }

private:
    bool valid_seq(seq_id_t s) const noexcept {
        return s >= 0 && static_cast<std::uint32_t>(s) < full_.shape().n_seq_max;
    }
    /// [p0, p1) as the caches read it: p0 < 0 means 0, p1 < 0 means the end.
    static std::pair<std::int64_t, std::int64_t> normalized(pos_t p0, pos_t p1) noexcept {
        return {p0 < 0 ? 0 : p0, p1 < 0 ? std::int64_t{std::numeric_limits<pos_t>::max()} + 1 : p1};
    }
    /// What the ring would refuse in a seq_add / seq_div (new position = f(old)), checked
    /// before either cache changes. Invalid arguments are left to the full cache, which
    /// refuses them first with the usual message.
    result<void> check_ring_move(const char* fn, seq_id_t s, pos_t p0, pos_t p1, position_move f) const {
        if (full_.in_transaction() || !(s < 0 || valid_seq(s))) return {};
        const auto [lo, hi] = normalized(p0, p1);
        if (lo > hi) return {};
        if constexpr (!can_shift) return {};  // the full cache throws unsupported first
        if constexpr (has_capability<swa_storage, layout_caps::seq_shift_check>)
            if (result<void> r = swa_.storage().check_seq_shift(swa_.cells(), fn, s, lo, hi, f); !r) return r;
        if (s < 0) return {};  // every sequence moves together: nothing is split
        const cell_table& cells = swa_.cells();
        std::uint32_t splits = 0;
        for (std::uint32_t c : cells.used_cells()) {
            const pos_t p = cells.pos(c);
            if (p < lo || p >= hi || !cells.seqs(c).test(s) || cells.seqs(c).count() < 2) continue;
            splits += f(p) != p && f(p) >= 0;
        }
        if (splits > cells.free_count())
            return detail::make_error(errc::no_space, std::string(fn) + ": moving sequence " + std::to_string(s) +
                                                          " needs " + std::to_string(splits) +
                                                          " free cells in the sliding-window cache to split shared "
                                                          "cells, " + std::to_string(cells.free_count()) + " free");
        return {};
    }
    template <class R>
    void write(const char* fn, std::uint32_t l, const iswa_placement& p, const R* rows, bool is_v) {
        const auto [sw, local] = map_.at(check_layer(fn, l));
        if (sw && is_v)
            swa_.write_v(local, p.swa.cells, rows);
        else if (sw)
            swa_.write_k(local, p.swa.cells, rows);
        else if (is_v)
            full_.write_v(local, p.full.cells, rows);
        else
            full_.write_k(local, p.full.cells, rows);
    }
    std::uint32_t check_layer(const char* fn, std::uint32_t l) const {
        if (l >= n_layer_)
            detail::fail(errc::invalid_argument, std::string(fn) + ": layer = " + std::to_string(l) +
                                                     ", must be < n_layer = " + std::to_string(n_layer_));
        return l;
    }
    static std::vector<std::pair<bool, std::uint32_t>> layer_map(const iswa_shape& s) {
        if (s.swa_layers.size() != s.shape.n_layer)
            detail::fail(errc::invalid_config, "iswa_shape.swa_layers has " + std::to_string(s.swa_layers.size()) +
                                                   " entries, must equal shape.n_layer = " +
                                                   std::to_string(s.shape.n_layer));
        if (s.swa_rope) {
            s.swa_rope->validate(s.shape.head_dim_k, errc::invalid_config, "iswa_shape.swa_rope.");
            if (s.swa_rope->mrope.on() != s.shape.rope.mrope.on())
                detail::fail(errc::invalid_config, "iswa_shape.swa_rope.mrope: M-RoPE must be on in both parts or in "
                                                   "neither (shape.rope.mrope)");
        }
        std::vector<std::pair<bool, std::uint32_t>> m;
        std::uint32_t n_swa = 0, n_full = 0;
        for (bool sw : s.swa_layers) m.emplace_back(sw, sw ? n_swa++ : n_full++);
        if (n_swa == 0 || n_full == 0)
            detail::fail(errc::invalid_config, std::string("iswa_shape.swa_layers: no ") +
                                                   (n_swa == 0 ? "sliding-window" : "full-attention") +
                                                   " layer; use kv_cache directly");
        return m;
    }
    static model_shape group_shape(const iswa_shape& s, bool swa) {
        model_shape g = s.shape;
        std::uint32_t n = 0;
        for (bool sw : s.swa_layers) n += sw == swa;
        g.n_layer = n;
        if (swa) g.n_cells = s.swa_n_cells;
        if (swa && s.swa_rope) g.rope = *s.swa_rope;
        return g;
    }

    std::vector<std::pair<bool, std::uint32_t>> map_;  // per model layer: (is SWA, index in its cache)
    full_cache full_;
    swa_cache swa_;
    std::uint32_t n_layer_;
};

namespace reuse {
/// reuse::apply_plan on an ISWA cache (F19, F20): everything apply_plan checks on one
/// cache (free cells to split shared cells, the ring's check_seq_steps over every call)
/// is checked on both parts before either changes, then the calls run on the ISWA cache,
/// whose sequence operations change both parts. Returns and throws as apply_plan; the
/// cache is unchanged when it refuses or throws.
template <std::uint32_t Window, class... Policies>
[[nodiscard]] result<void> apply_plan(iswa_cache<Window, Policies...>& cache, seq_id_t seq, const plan& p) {
    using std::to_string;
    check_apply_args(seq, cache.n_seq_max(), cache.in_transaction(), p);
    std::vector<seq_step> steps;
    for_each_step(p, [&](const seq_step& st) { steps.push_back(st); });
    if (!p.moves.empty()) {
        if constexpr (!iswa_cache<Window, Policies...>::can_shift)
            detail::fail(errc::unsupported, "apply_plan: the plan moves chunks but the ISWA cache cannot move positions");
        result<void> room;
        cache.for_each_part([&](const auto& part) {
            const std::uint32_t need = cells_needed(part, seq, p);
            if (room && need > part.capacity() - part.used())
                room = detail::make_error(errc::no_space, "apply_plan: moving chunks needs " + to_string(need) +
                                                              " free cells to split shared cells, " +
                                                              to_string(part.capacity() - part.used()) + " free");
        });
        if (!room) return room;
    }
    // The ring's rules (pruned positions) for every call, moves or truncation alone.
    if (result<void> r = cache.swa().storage().check_seq_steps(cache.swa().cells(), seq,
                                                               std::span<const seq_step>(steps), "apply_plan");
        !r)
        return r;
    return detail::with_rollback(cache, [&]() -> result<void> {  // a refusal or throw changes nothing
        for (const seq_step& st : steps)
            if (result<void> r = run_step(cache, seq, st); !r) return r;
        return {};
    });
}
}  // namespace reuse

static_assert(composite_memory<iswa_cache<64>>, "kvcache: iswa_cache must satisfy kvcache::composite_memory");

KVCACHE_END_NAMESPACE
