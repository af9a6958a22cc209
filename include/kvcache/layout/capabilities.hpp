// kvcache: layout capabilities, the optional hooks a layout's storage may provide.
//
// A layout's storage<Element> must satisfy kvcache::kv_storage (concepts.hpp): the
// physical K/V format of format/kv_view.hpp, most simply by deriving from
// kvcache::tiled_kv_storage (layout/kv_storage.hpp). Everything else a layout does
// (choosing cells, pruning, refusing sequence operations, accounting) is an optional
// capability: the storage DECLARES it in one flag set,
//
//     static constexpr kvcache::layout_caps capabilities =
//         kvcache::layout_caps::placement_plan | kvcache::layout_caps::commit_hook;
//
// and DEFINES the hook with the signature listed below. The library calls a hook only
// where the capability is declared (has_capability<Storage, C>), never by probing for
// member names, and kv_cache checks every storage with check_layout_capabilities():
//   - a declared capability whose hook is missing or has another signature is a compile
//     error naming the capability ("kvcache: layout capability 'placement_plan' ...");
//   - a member named like a hook (plan_place, on_commit, ...) whose capability is not
//     declared is a compile error too, so a misspelled or forgotten flag never turns a
//     behaviour off silently.
// No declaration (or layout_caps::none, tiled_kv_storage's) means: the cache places
// tokens with its own slot search, commits do nothing more, every sequence operation is
// allowed, held cells = used cells.
//
// The capabilities, their hooks (exact signatures; `const` where shown) and meaning:
//
//   cell_observer     cell_observer* observer();
//       The cache registers the returned observer (address stable for the storage's
//       lifetime) with its cell table: the storage follows every change of a cell's
//       sequences (block tables, regions). ops::defrag refuses such layouts.
//   placement_plan    result<placement_plan> plan_place(const cell_table&, std::span<const pos_t> pos,
//                                                       std::span<const seq_set> seqs);
//       The layout picks the cells of a micro-batch (token i -> cells[i]) and any
//       copy-on-write of shared cells (copies, applied first). An error result (no_space)
//       is returned by place() unchanged. Must not change the cell table. Also used by
//       state loading when load_plan is not declared (a plan with copies is refused).
//   load_plan         result<load_plan> plan_load(const cell_table&, std::span<const pos_t> pos,
//                                                 std::span<const seq_set> seqs);
//       Where a loaded state goes (io::load_state has no transaction): moves of existing
//       cells first, then saved cell i -> cells[i]. Takes precedence over placement_plan
//       in state loading.
//   commit_hook       void on_commit(cell_table&);
//       Runs after every commit() that made staged placements permanent (ring: prunes
//       the cells that left the window). May change the cell table and may throw
//       (std::bad_alloc): commit() then puts the cells and the layout's tables back.
// Refusals: a hook that refuses an expected runtime condition (positions the layout
// dropped, no free block) returns an error result (errc::unsupported, errc::no_space)
// that the cache returns unchanged from the sequence operation, nothing changed; a hook
// throws kvcache::error only for a programming error (invalid argument).
//
//   seq_rm_check      result<void> check_seq_rm(const cell_table&, seq_id_t s, std::int64_t lo,
//                                               std::int64_t hi) const;
//       An error result refuses seq_rm(s, [lo, hi)) (s < 0: every sequence) before
//       anything changes.
//   seq_cp_check      result<void> check_seq_cp(const cell_table&, seq_id_t src, seq_id_t dst, std::int64_t lo,
//                                               std::int64_t hi) const;
//       An error result refuses seq_cp(src -> dst, [lo, hi)); has no side effects
//       (memories made of several caches call it before any of them changes).
//   seq_cp_hook       result<void> before_seq_cp(const cell_table&, seq_id_t src, seq_id_t dst, std::int64_t lo,
//                                                std::int64_t hi);
//       Runs before seq_cp shares the cells (after the cache validated it); an error
//       result refuses with nothing changed; on success it may update the layout's own
//       tables (ring: dst inherits src's pruning point). Without it, the cache calls
//       check_seq_cp when seq_cp_check is declared.
//   seq_shift_check   result<void> check_seq_shift(const cell_table&, const char* fn, seq_id_t s, std::int64_t lo,
//                                                  std::int64_t hi, position_move f) const;
//       An error result refuses seq_add / seq_div (fn names which) of s over [lo, hi)
//       moving position p to f(p) (cells/seq_step.hpp). A member template over F is fine.
//   seq_steps_check   result<void> check_seq_steps(const cell_table&, seq_id_t s, std::span<const seq_step> steps,
//                                                  const char* what) const;
//       An error result refuses a whole list of seq_rm / seq_add / seq_div calls on s
//       before the first runs (ops::context_shift, ops::self_extend, reuse::apply_plan;
//       `what` names the caller), for layouts whose rules depend on the steps before.
//   split_targets     result<std::vector<std::uint32_t>> split_targets(const cell_table&, seq_id_t s,
//                                                                      std::uint32_t n);
//       n free cells for the copies of shared cells that s splits off when it moves (the
//       cache checked that n cells are free), or an error result (no_space: the layout
//       has no room for them, e.g. no free block). Default: the lowest free cells.
//   pruning           pos_t pruned_below(seq_id_t s) const;   void set_pruned_below(seq_id_t s, pos_t w);
//       Positions of s below pruned_below(s) may be missing (dropped by the layout);
//       state files save and restore these points.
//   sliding_window    std::uint32_t window() const;
//       The attention window the layout keeps (written into state fingerprints; 0 and no
//       declaration: every cell is kept).
//   held_cells        std::uint64_t held_cells(const cell_table&) const;
//       Cells unavailable to other sequences (whole blocks or regions), >= used cells;
//       ops::memory reports them as held bytes.
//   tile_ranges       void tile_ranges(seq_id_t s, std::vector<std::pair<std::uint32_t, std::uint32_t>>& out) const;
//       K tile ranges [first, last) holding s's cells: what attention visits for a batch
//       of one sequence instead of every tile of the window.
//
// A minimal conforming layout with a capability: examples/custom_layout.cpp.
#pragma once

#include <concepts>     // std::same_as, std::convertible_to
#include <cstdint>      // fixed-width integers
#include <span>         // hook arguments
#include <type_traits>  // std::is_final_v, std::underlying_type_t
#include <utility>      // std::pair
#include <vector>       // plans, tile ranges

#include "../cells/cell_table.hpp"
#include "../cells/seq_step.hpp"
#include "../error.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Copy-on-write step of a placement: sequence `seq` leaves shared cell `src` for its
/// own copy `dst` (K/V of every layer copied, same position and pending shift).
struct cell_copy {
    std::uint32_t src = 0;
    std::uint32_t dst = 0;
    seq_id_t seq = 0;
};

/// A layout's answer to "where does this micro-batch go" (capability placement_plan;
/// layouts without it use the cache's head-based slot search, F3). copies are applied
/// first, then token i goes to cells[i].
struct placement_plan {
    std::vector<std::uint32_t> cells;
    std::vector<cell_copy> copies;
};

/// Where a loaded state goes (capability load_plan): first each move (a cell with all
/// its sequences, K/V and pending shift, from `from` to the free cell `to`), then saved
/// cell i to cells[i].
struct load_plan {
    struct move {
        std::uint32_t from = 0;
        std::uint32_t to = 0;
    };
    std::vector<std::uint32_t> cells;
    std::vector<move> moves;
};

/// The capabilities a layout storage may declare in `static constexpr layout_caps
/// capabilities` (combine with |); each names one hook, see the file comment.
enum class layout_caps : std::uint32_t {
    none = 0,
    cell_observer = 1u << 0,     ///< cell_observer* observer()
    placement_plan = 1u << 1,    ///< plan_place(cells, pos, seqs) -> result<placement_plan>
    load_plan = 1u << 2,         ///< plan_load(cells, pos, seqs) -> result<load_plan>
    commit_hook = 1u << 3,       ///< on_commit(cells)
    seq_rm_check = 1u << 4,      ///< check_seq_rm(cells, s, lo, hi) const -> result<void>
    seq_cp_check = 1u << 5,      ///< check_seq_cp(cells, src, dst, lo, hi) const -> result<void>
    seq_cp_hook = 1u << 6,       ///< before_seq_cp(cells, src, dst, lo, hi) -> result<void>
    seq_shift_check = 1u << 7,   ///< check_seq_shift(cells, fn, s, lo, hi, position_move) const -> result<void>
    seq_steps_check = 1u << 8,   ///< check_seq_steps(cells, s, steps, what) const -> result<void>
    split_targets = 1u << 9,     ///< split_targets(cells, s, n) -> result<std::vector<std::uint32_t>>
    pruning = 1u << 10,          ///< pruned_below(s) const, set_pruned_below(s, w)
    sliding_window = 1u << 11,   ///< window() const
    held_cells = 1u << 12,       ///< held_cells(cells) const -> std::uint64_t
    tile_ranges = 1u << 13,      ///< tile_ranges(s, out) const
};

[[nodiscard]] constexpr layout_caps operator|(layout_caps a, layout_caps b) noexcept {
    return static_cast<layout_caps>(static_cast<std::uint32_t>(a) | static_cast<std::uint32_t>(b));
}
[[nodiscard]] constexpr layout_caps operator&(layout_caps a, layout_caps b) noexcept {
    return static_cast<layout_caps>(static_cast<std::uint32_t>(a) & static_cast<std::uint32_t>(b));
}

namespace detail {
/// The capability set a storage declares (none when it declares nothing).
template <class S>
[[nodiscard]] constexpr layout_caps declared_caps() noexcept {
    if constexpr (requires { S::capabilities; })
        return static_cast<layout_caps>(S::capabilities);
    else
        return layout_caps::none;
}
}  // namespace detail

/// Whether storage type S declares capability C (the only test call sites use).
template <class S, layout_caps C>
inline constexpr bool has_capability =
    (detail::declared_caps<std::remove_cvref_t<S>>() & C) != layout_caps::none;

/// has_capability for the storage of a cache type (false for memories without one
/// layout storage, e.g. a cache made of two caches).
template <class Cache, layout_caps C>
[[nodiscard]] constexpr bool cache_has_capability() noexcept {
    if constexpr (requires { typename Cache::storage_t; })
        return has_capability<typename Cache::storage_t, C>;
    else
        return false;
}

// ---------------------------------------------------------------------------
// One concept per capability: the hook exists with the documented signature.

template <class S>
concept observer_hook = requires(S& s) {
    { s.observer() } -> std::convertible_to<cell_observer*>;
};

template <class S>
concept placement_plan_hook =
    requires(S& s, const cell_table& c, std::span<const pos_t> p, std::span<const seq_set> q) {
        { s.plan_place(c, p, q) } -> std::same_as<result<placement_plan>>;
    };

template <class S>
concept load_plan_hook = requires(S& s, const cell_table& c, std::span<const pos_t> p, std::span<const seq_set> q) {
    { s.plan_load(c, p, q) } -> std::same_as<result<load_plan>>;
};

template <class S>
concept on_commit_hook = requires(S& s, cell_table& c) {
    s.on_commit(c);
};

template <class S>
concept seq_rm_check_hook = requires(const S& s, const cell_table& c, seq_id_t q, std::int64_t x) {
    { s.check_seq_rm(c, q, x, x) } -> std::same_as<result<void>>;
};

template <class S>
concept seq_cp_check_hook = requires(const S& s, const cell_table& c, seq_id_t q, std::int64_t x) {
    { s.check_seq_cp(c, q, q, x, x) } -> std::same_as<result<void>>;
};

template <class S>
concept before_seq_cp_hook = requires(S& s, const cell_table& c, seq_id_t q, std::int64_t x) {
    { s.before_seq_cp(c, q, q, x, x) } -> std::same_as<result<void>>;
};

template <class S>
concept seq_shift_check_hook =
    requires(const S& s, const cell_table& c, const char* fn, seq_id_t q, std::int64_t x, position_move f) {
        { s.check_seq_shift(c, fn, q, x, x, f) } -> std::same_as<result<void>>;
    };

template <class S>
concept seq_steps_check_hook =
    requires(const S& s, const cell_table& c, seq_id_t q, std::span<const seq_step> st, const char* what) {
        { s.check_seq_steps(c, q, st, what) } -> std::same_as<result<void>>;
    };

template <class S>
concept split_targets_hook = requires(S& s, const cell_table& c, seq_id_t q, std::uint32_t n) {
    { s.split_targets(c, q, n) } -> std::same_as<result<std::vector<std::uint32_t>>>;
};

template <class S>
concept pruning_hook = requires(S& s, const S& cs, seq_id_t q, pos_t w) {
    { cs.pruned_below(q) } -> std::same_as<pos_t>;
    s.set_pruned_below(q, w);
};

template <class S>
concept sliding_window_hook = requires(const S& s) {
    { s.window() } -> std::convertible_to<std::uint32_t>;
};

template <class S>
concept held_cells_hook = requires(const S& s, const cell_table& c) {
    { s.held_cells(c) } -> std::convertible_to<std::uint64_t>;
};

template <class S>
concept tile_ranges_hook =
    requires(const S& s, seq_id_t q, std::vector<std::pair<std::uint32_t, std::uint32_t>>& out) {
        s.tile_ranges(q, out);
    };

// ---------------------------------------------------------------------------
// Whether a storage has a member named like a hook, whatever its signature (a member
// template or an overload set too): deriving from S and from a class with a member of
// that name makes the name ambiguous exactly when S has one. Final classes cannot be
// probed (and are not checked for undeclared hooks).

namespace detail {
#define KVCACHE_DETAIL_HOOK_NAME(hook)                                                  \
    struct hook_name_##hook {                                                           \
        int hook;                                                                       \
    };                                                                                  \
    template <class S>                                                                  \
    struct hook_probe_##hook : S, hook_name_##hook {};                                  \
    template <class S>                                                                  \
    concept names_##hook = std::is_class_v<S> && !std::is_final_v<S> &&                 \
                           !requires { &hook_probe_##hook<S>::hook; };

KVCACHE_DETAIL_HOOK_NAME(observer)
KVCACHE_DETAIL_HOOK_NAME(plan_place)
KVCACHE_DETAIL_HOOK_NAME(plan_load)
KVCACHE_DETAIL_HOOK_NAME(on_commit)
KVCACHE_DETAIL_HOOK_NAME(check_seq_rm)
KVCACHE_DETAIL_HOOK_NAME(check_seq_cp)
KVCACHE_DETAIL_HOOK_NAME(before_seq_cp)
KVCACHE_DETAIL_HOOK_NAME(check_seq_shift)
KVCACHE_DETAIL_HOOK_NAME(check_seq_steps)
KVCACHE_DETAIL_HOOK_NAME(split_targets)
KVCACHE_DETAIL_HOOK_NAME(pruned_below)
KVCACHE_DETAIL_HOOK_NAME(set_pruned_below)
KVCACHE_DETAIL_HOOK_NAME(window)
KVCACHE_DETAIL_HOOK_NAME(held_cells)
KVCACHE_DETAIL_HOOK_NAME(tile_ranges)
#undef KVCACHE_DETAIL_HOOK_NAME

/// Checks a layout storage against its declared capabilities (see the file comment);
/// kv_cache static_asserts it. Each failure is a static_assert naming the capability.
template <class S>
constexpr bool check_layout_capabilities() {
    if constexpr (requires { S::capabilities; })
        static_assert(std::same_as<std::remove_cv_t<decltype(S::capabilities)>, layout_caps>,
                      "kvcache: a layout storage's `capabilities` must be a `static constexpr kvcache::layout_caps` "
                      "(see kvcache/layout/capabilities.hpp)");
    constexpr layout_caps c = declared_caps<S>();
    constexpr auto has = [](layout_caps x) { return (c & x) != layout_caps::none; };

    static_assert(!has(layout_caps::cell_observer) || observer_hook<S>,
                  "kvcache: layout capability 'cell_observer' is declared but the storage has no "
                  "`cell_observer* observer()` (see kvcache/layout/capabilities.hpp)");
    static_assert(has(layout_caps::cell_observer) || !names_observer<S>,
                  "kvcache: the layout storage defines observer() but does not declare layout capability "
                  "'cell_observer' in `capabilities` (see kvcache/layout/capabilities.hpp)");

    static_assert(!has(layout_caps::placement_plan) || placement_plan_hook<S>,
                  "kvcache: layout capability 'placement_plan' is declared but the storage has no "
                  "`result<placement_plan> plan_place(const cell_table&, std::span<const pos_t>, "
                  "std::span<const seq_set>)` (see kvcache/layout/capabilities.hpp)");
    static_assert(has(layout_caps::placement_plan) || !names_plan_place<S>,
                  "kvcache: the layout storage defines plan_place() but does not declare layout capability "
                  "'placement_plan' in `capabilities` (see kvcache/layout/capabilities.hpp)");

    static_assert(!has(layout_caps::load_plan) || load_plan_hook<S>,
                  "kvcache: layout capability 'load_plan' is declared but the storage has no "
                  "`result<load_plan> plan_load(const cell_table&, std::span<const pos_t>, "
                  "std::span<const seq_set>)` (see kvcache/layout/capabilities.hpp)");
    static_assert(has(layout_caps::load_plan) || !names_plan_load<S>,
                  "kvcache: the layout storage defines plan_load() but does not declare layout capability "
                  "'load_plan' in `capabilities` (see kvcache/layout/capabilities.hpp)");

    static_assert(!has(layout_caps::commit_hook) || on_commit_hook<S>,
                  "kvcache: layout capability 'commit_hook' is declared but the storage has no "
                  "`void on_commit(cell_table&)` (see kvcache/layout/capabilities.hpp)");
    static_assert(has(layout_caps::commit_hook) || !names_on_commit<S>,
                  "kvcache: the layout storage defines on_commit() but does not declare layout capability "
                  "'commit_hook' in `capabilities` (see kvcache/layout/capabilities.hpp)");

    static_assert(!has(layout_caps::seq_rm_check) || seq_rm_check_hook<S>,
                  "kvcache: layout capability 'seq_rm_check' is declared but the storage has no "
                  "`result<void> check_seq_rm(const cell_table&, seq_id_t, std::int64_t, std::int64_t) const` "
                  "(see kvcache/layout/capabilities.hpp)");
    static_assert(has(layout_caps::seq_rm_check) || !names_check_seq_rm<S>,
                  "kvcache: the layout storage defines check_seq_rm() but does not declare layout capability "
                  "'seq_rm_check' in `capabilities` (see kvcache/layout/capabilities.hpp)");

    static_assert(!has(layout_caps::seq_cp_check) || seq_cp_check_hook<S>,
                  "kvcache: layout capability 'seq_cp_check' is declared but the storage has no "
                  "`result<void> check_seq_cp(const cell_table&, seq_id_t, seq_id_t, std::int64_t, std::int64_t) const` "
                  "(see kvcache/layout/capabilities.hpp)");
    static_assert(has(layout_caps::seq_cp_check) || !names_check_seq_cp<S>,
                  "kvcache: the layout storage defines check_seq_cp() but does not declare layout capability "
                  "'seq_cp_check' in `capabilities` (see kvcache/layout/capabilities.hpp)");

    static_assert(!has(layout_caps::seq_cp_hook) || before_seq_cp_hook<S>,
                  "kvcache: layout capability 'seq_cp_hook' is declared but the storage has no "
                  "`result<void> before_seq_cp(const cell_table&, seq_id_t, seq_id_t, std::int64_t, std::int64_t)` "
                  "(see kvcache/layout/capabilities.hpp)");
    static_assert(has(layout_caps::seq_cp_hook) || !names_before_seq_cp<S>,
                  "kvcache: the layout storage defines before_seq_cp() but does not declare layout capability "
                  "'seq_cp_hook' in `capabilities` (see kvcache/layout/capabilities.hpp)");

    static_assert(!has(layout_caps::seq_shift_check) || seq_shift_check_hook<S>,
                  "kvcache: layout capability 'seq_shift_check' is declared but the storage has no "
                  "`result<void> check_seq_shift(const cell_table&, const char*, seq_id_t, std::int64_t, std::int64_t, "
                  "position_move) const` (see kvcache/layout/capabilities.hpp)");
    static_assert(has(layout_caps::seq_shift_check) || !names_check_seq_shift<S>,
                  "kvcache: the layout storage defines check_seq_shift() but does not declare layout capability "
                  "'seq_shift_check' in `capabilities` (see kvcache/layout/capabilities.hpp)");

    static_assert(!has(layout_caps::seq_steps_check) || seq_steps_check_hook<S>,
                  "kvcache: layout capability 'seq_steps_check' is declared but the storage has no "
                  "`result<void> check_seq_steps(const cell_table&, seq_id_t, std::span<const seq_step>, const char*) "
                  "const` (see kvcache/layout/capabilities.hpp)");
    static_assert(has(layout_caps::seq_steps_check) || !names_check_seq_steps<S>,
                  "kvcache: the layout storage defines check_seq_steps() but does not declare layout capability "
                  "'seq_steps_check' in `capabilities` (see kvcache/layout/capabilities.hpp)");

    static_assert(!has(layout_caps::split_targets) || split_targets_hook<S>,
                  "kvcache: layout capability 'split_targets' is declared but the storage has no "
                  "`result<std::vector<std::uint32_t>> split_targets(const cell_table&, seq_id_t, std::uint32_t)` "
                  "(see kvcache/layout/capabilities.hpp)");
    static_assert(has(layout_caps::split_targets) || !names_split_targets<S>,
                  "kvcache: the layout storage defines split_targets() but does not declare layout capability "
                  "'split_targets' in `capabilities` (see kvcache/layout/capabilities.hpp)");

    static_assert(!has(layout_caps::pruning) || pruning_hook<S>,
                  "kvcache: layout capability 'pruning' is declared but the storage has no "
                  "`pos_t pruned_below(seq_id_t) const` and `void set_pruned_below(seq_id_t, pos_t)` "
                  "(see kvcache/layout/capabilities.hpp)");
    static_assert(has(layout_caps::pruning) || (!names_pruned_below<S> && !names_set_pruned_below<S>),
                  "kvcache: the layout storage defines pruned_below() or set_pruned_below() but does not declare "
                  "layout capability 'pruning' in `capabilities` (see kvcache/layout/capabilities.hpp)");

    static_assert(!has(layout_caps::sliding_window) || sliding_window_hook<S>,
                  "kvcache: layout capability 'sliding_window' is declared but the storage has no "
                  "`std::uint32_t window() const` (see kvcache/layout/capabilities.hpp)");
    static_assert(has(layout_caps::sliding_window) || !names_window<S>,
                  "kvcache: the layout storage defines window() but does not declare layout capability "
                  "'sliding_window' in `capabilities` (see kvcache/layout/capabilities.hpp)");

    static_assert(!has(layout_caps::held_cells) || held_cells_hook<S>,
                  "kvcache: layout capability 'held_cells' is declared but the storage has no "
                  "`std::uint64_t held_cells(const cell_table&) const` (see kvcache/layout/capabilities.hpp)");
    static_assert(has(layout_caps::held_cells) || !names_held_cells<S>,
                  "kvcache: the layout storage defines held_cells() but does not declare layout capability "
                  "'held_cells' in `capabilities` (see kvcache/layout/capabilities.hpp)");

    static_assert(!has(layout_caps::tile_ranges) || tile_ranges_hook<S>,
                  "kvcache: layout capability 'tile_ranges' is declared but the storage has no "
                  "`void tile_ranges(seq_id_t, std::vector<std::pair<std::uint32_t, std::uint32_t>>&) const` "
                  "(see kvcache/layout/capabilities.hpp)");
    static_assert(has(layout_caps::tile_ranges) || !names_tile_ranges<S>,
                  "kvcache: the layout storage defines tile_ranges() but does not declare layout capability "
                  "'tile_ranges' in `capabilities` (see kvcache/layout/capabilities.hpp)");
    return true;
}
}  // namespace detail

KVCACHE_END_NAMESPACE
