// Layout capabilities (layout/capabilities.hpp): the flags the built-in layouts declare,
// the hook-name probes behind "defined but not declared", the per-capability signature
// concepts, and a user layout whose declared hooks are the ones the cache calls.
#include <doctest/doctest.h>

#include <kvcache/element/f16.hpp>
#include <kvcache/element/f32.hpp>
#include <kvcache/io/state.hpp>
#include <kvcache/layout/capabilities.hpp>
#include <kvcache/layout/contiguous.hpp>
#include <kvcache/layout/paged.hpp>
#include <kvcache/layout/ring.hpp>
#include <kvcache/memory/kv_cache.hpp>
#include <kvcache/ops/memory.hpp>

#include <cstdint>
#include <span>
#include <vector>

#include "layout_test_util.hpp"
#include "support/cache_snapshot.hpp"
#include "support/result_check.hpp"

namespace {

using namespace kvcache;

using contiguous_st = contiguous<>::storage<f32>;
using ring_st = ring<8>::storage<f16>;
using paged_st = paged<32>::storage<f32>;

// ---- the declared flags of the built-in layouts
static_assert(detail::declared_caps<contiguous_st>() == layout_caps::none);
static_assert(!has_capability<contiguous_st, layout_caps::placement_plan>);
static_assert(has_capability<ring_st, layout_caps::placement_plan> && has_capability<ring_st, layout_caps::load_plan> &&
              has_capability<ring_st, layout_caps::commit_hook> && has_capability<ring_st, layout_caps::pruning> &&
              has_capability<ring_st, layout_caps::sliding_window> &&
              has_capability<ring_st, layout_caps::seq_steps_check> && !has_capability<ring_st, layout_caps::tile_ranges>);
static_assert(has_capability<paged_st, layout_caps::tile_ranges> && has_capability<paged_st, layout_caps::split_targets> &&
              !has_capability<paged_st, layout_caps::commit_hook> && !has_capability<paged_st, layout_caps::pruning>);
static_assert(has_capability<const ring_st&, layout_caps::cell_observer>, "cv-ref qualified storage types");
static_assert(cache_has_capability<kv_cache<f16, ring<8>>, layout_caps::pruning>());
static_assert(!cache_has_capability<int, layout_caps::pruning>(), "a type without storage_t has no capability");

// ---- every declared hook satisfies its signature concept; the check passes
static_assert(detail::check_layout_capabilities<contiguous_st>());
static_assert(detail::check_layout_capabilities<ring_st>());
static_assert(detail::check_layout_capabilities<paged_st>());
static_assert(placement_plan_hook<ring_st> && load_plan_hook<ring_st> && on_commit_hook<ring_st> &&
              seq_rm_check_hook<ring_st> && seq_cp_check_hook<ring_st> && before_seq_cp_hook<ring_st> &&
              seq_shift_check_hook<ring_st> && seq_steps_check_hook<ring_st> && split_targets_hook<ring_st> &&
              pruning_hook<ring_st> && sliding_window_hook<ring_st> && held_cells_hook<ring_st>);
static_assert(placement_plan_hook<paged_st> && tile_ranges_hook<paged_st> && observer_hook<paged_st>);

// ---- kv_storage: the physical format is part of the storage contract
static_assert(kv_storage<contiguous_st> && kv_storage<ring_st> && kv_storage<paged_st>);
struct no_view_storage {
    using storage_type = float;
    std::size_t bytes() const { return 0; }
    std::uint32_t n_cells_padded() const { return 0; }
    void write_k(std::uint32_t, std::uint32_t, const float*) {}
    void write_v(std::uint32_t, std::uint32_t, const float*) {}
    void read_k(std::uint32_t, std::uint32_t, float*) const {}
    void read_v(std::uint32_t, std::uint32_t, float*) const {}
    void copy_cell(std::uint32_t, std::uint32_t) {}
};
static_assert(!storage_has_view<no_view_storage> && !kv_storage<no_view_storage>);

// ---- hook-name probes: any member named like a hook is found, whatever its signature
struct names_nothing {};
struct names_template {
    template <class F>
    void check_seq_shift(F) const {}
};
struct names_overloads {
    void tile_ranges(int) const {}
    void tile_ranges(int, int) const {}
};
struct names_data {
    int window = 0;
};
struct names_private {
private:
    void on_commit() {}
};
struct final_names final {
    void on_commit() {}
};
static_assert(!detail::names_on_commit<names_nothing> && !detail::names_window<names_nothing>);
static_assert(detail::names_check_seq_shift<names_template>);
static_assert(detail::names_tile_ranges<names_overloads>);
static_assert(detail::names_window<names_data>);
static_assert(detail::names_on_commit<names_private>);
static_assert(!detail::names_on_commit<final_names>, "final classes cannot be probed");
static_assert(detail::names_plan_place<ring_st> && detail::names_window<ring_st> && !detail::names_tile_ranges<ring_st>);

// ---- wrong signatures do not satisfy the concepts (what the static_asserts report)
struct wrong_hooks {
    std::vector<std::uint32_t> plan_place(const cell_table&, std::span<const pos_t>, std::span<const seq_set>) {
        return {};
    }
    void on_commit(const int&) {}                      // wrong argument
    int pruned_below(seq_id_t) const { return 0; }      // pos_t is int: fine, but no set_pruned_below
    void check_seq_rm(cell_table&, seq_id_t, std::int64_t, std::int64_t) {}  // not const
    void check_seq_cp(const cell_table&, seq_id_t, seq_id_t, std::int64_t, std::int64_t) const {}  // returns void
    std::vector<std::uint32_t> split_targets(const cell_table&, seq_id_t, std::uint32_t) { return {}; }  // not a result
};
static_assert(!placement_plan_hook<wrong_hooks> && !on_commit_hook<wrong_hooks> && !pruning_hook<wrong_hooks> &&
              !seq_rm_check_hook<wrong_hooks> && !seq_cp_check_hook<wrong_hooks> && !split_targets_hook<wrong_hooks>);

// ---- a user layout: the declared hooks are what the cache calls
struct counting_layout {
    using policy_kind = layout_tag;
    static constexpr std::string_view name = "counting";
    static constexpr std::uint32_t layout_id = 200;
    static constexpr bool can_shift = true;

    template <class Element>
    class storage : public tiled_kv_storage<Element, v_layout::row_major> {
    public:
        static constexpr layout_caps capabilities = layout_caps::commit_hook | layout_caps::seq_rm_check |
                                                    layout_caps::seq_shift_check | layout_caps::held_cells;
        using tiled_kv_storage<Element, v_layout::row_major>::tiled_kv_storage;

        void on_commit(cell_table&) noexcept { ++commits; }
        /// Refuses removing position 0 of any sequence (an unsupported result).
        result<void> check_seq_rm(const cell_table&, seq_id_t, std::int64_t lo, std::int64_t) const {
            if (lo <= 0) return detail::make_error(errc::unsupported, "counting: position 0 is pinned");
            return {};
        }
        result<void> check_seq_shift(const cell_table&, const char* fn, seq_id_t, std::int64_t, std::int64_t,
                                     position_move f) const {
            last_fn = fn;
            last_move = f;
            return {};
        }
        std::uint64_t held_cells(const cell_table& cells) const noexcept { return cells.size(); }

        int commits = 0;
        mutable const char* last_fn = nullptr;
        mutable position_move last_move{};
    };
};

}  // namespace

TEST_CASE("a user layout's declared hooks are called by the cache") {
    const model_shape s = kvtest::layout_shape(64, 2);
    kv_cache<counting_layout> cache(s);
    const std::vector<pos_t> pos{0, 1, 2, 3};
    const std::vector<seq_id_t> seq(4, 0);
    {
        auto r = cache.place(pos, seq);
        REQUIRE(r.ok());
        CHECK(cache.storage().commits == 0);
        CHECK(cache.commit() == tx_result::committed);
    }
    CHECK(cache.storage().commits == 1);
    CHECK(cache.commit() == tx_result::nothing_staged);
    CHECK(cache.storage().commits == 1);  // only a commit of staged placements runs the hook

    // seq_rm_check refuses: its error result comes back from seq_rm, nothing changed
    const auto before = kvtest::snapshot(cache);
    const auto refused = cache.seq_rm(0, 0, 2);
    CHECK(kvtest::refused_with(refused, errc::unsupported, "counting: position 0 is pinned"));
    CHECK(kvtest::snapshot(cache) == before);
    CHECK(cache.used() == 4);
    REQUIRE(cache.seq_rm(0, 3, -1));
    CHECK(cache.used() == 3);

    // seq_shift_check receives the move as a position_move
    REQUIRE(cache.seq_add(0, 1, -1, 7));
    REQUIRE(cache.storage().last_fn != nullptr);
    CHECK(std::string(cache.storage().last_fn) == "seq_add");
    CHECK(cache.storage().last_move(5) == 12);
    REQUIRE(cache.seq_div(0, 0, 9, 2));  // positions 0, 8 -> 0, 4; 9 stays
    CHECK(std::string(cache.storage().last_fn) == "seq_div");
    CHECK(cache.storage().last_move(9) == 4);
    CHECK(cache.seq_pos_max(0) == 9);
    CHECK(cache.cells().seq_has_pos(0, 4));

    // held_cells feeds the memory report
    const auto m = ops::memory(cache);
    CHECK(m.held_bytes == std::size_t{64} * cache.bytes_per_token());
    CHECK(m.used_bytes == std::size_t{3} * cache.bytes_per_token());
}

TEST_CASE("position_move: add and div as seq_add / seq_div apply them") {
    const position_move add{position_move::op::add, -3};
    const position_move div{position_move::op::div, 4};
    CHECK(add(2) == -1);
    CHECK(add(0x7fffffff) == std::int64_t{0x7fffffff} - 3);
    CHECK(div(7) == 1);
    CHECK(div(8) == 2);
}

TEST_CASE("ring storage reports its window through the sliding_window capability") {
    CHECK(ring_st::window() == 8);
    kv_cache<f32, ring<8>> cache(kvtest::layout_shape(ring<8>::cells_for(1, 4), 1));
    CHECK(io::detail::layout_window(cache) == 8);
    kv_cache<f32> plain(kvtest::layout_shape(64, 1));
    CHECK(io::detail::layout_window(plain) == 0);
}
