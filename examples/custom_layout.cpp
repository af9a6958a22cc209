// A user-written layout, from the documentation alone (kvcache/concepts.hpp and
// kvcache/layout/capabilities.hpp): "reversed" fills the cache from its last cell down.
//
// - The physical K/V format comes from deriving the storage from tiled_kv_storage, so
//   attention, the K-shift and state files read it like any built-in layout.
// - Its behaviour is two declared capabilities: placement_plan (it picks the cells of
//   each micro-batch) and held_cells (what ops::memory reports as held).
//
// The program runs the same tokens through kv_cache<f32, reversed> and the default
// contiguous cache and checks that placement, attention, the K-shift, save/load and the
// memory report behave as documented. It returns non-zero on any mismatch.
#include <kvcache/kvcache.hpp>

#include <cmath>
#include <cstdio>
#include <span>
#include <vector>

/// Layout policy: token i of a micro-batch goes to the highest free cell.
struct reversed {
    using policy_kind = kvcache::layout_tag;
    static constexpr std::string_view name = "reversed";
    static constexpr std::uint32_t layout_id = 100;  // stable id written into state files
    static constexpr bool can_shift = true;

    template <class Element>
    class storage : public kvcache::tiled_kv_storage<Element, kvcache::v_layout::row_major> {
        using base = kvcache::tiled_kv_storage<Element, kvcache::v_layout::row_major>;

    public:
        static constexpr kvcache::layout_caps capabilities =
            kvcache::layout_caps::placement_plan | kvcache::layout_caps::held_cells;

        explicit storage(const kvcache::model_shape& s) : base(s) {}

        /// placement_plan: the highest free cells, top down (the cache checked there are enough).
        [[nodiscard]] kvcache::result<kvcache::placement_plan> plan_place(const kvcache::cell_table& cells,
                                                                          std::span<const kvcache::pos_t> pos,
                                                                          std::span<const kvcache::seq_set>) const {
            kvcache::placement_plan plan;
            for (std::uint32_t c = cells.size(); c-- > 0 && plan.cells.size() < pos.size();)
                if (cells.is_free(c)) plan.cells.push_back(c);
            if (plan.cells.size() < pos.size())
                return kvcache::detail::make_error(kvcache::errc::no_space, "reversed: not enough free cells");
            return plan;
        }

        /// held_cells: every cell from the lowest used one to the top.
        [[nodiscard]] std::uint64_t held_cells(const kvcache::cell_table& cells) const noexcept {
            std::uint32_t lowest = cells.size();
            for (std::uint32_t c : cells.used_cells()) lowest = c < lowest ? c : lowest;
            return cells.size() - lowest;
        }
    };
};

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
    if (!ok) {
        std::printf("MISMATCH: %s\n", what);
        ++failures;
    }
}

float max_diff(const std::vector<float>& a, const std::vector<float>& b) {
    float m = 0.0f;
    for (std::size_t i = 0; i < a.size(); ++i) m = std::fmax(m, std::fabs(a[i] - b[i]));
    return m;
}

float value(std::uint32_t i) { return std::sin(0.37f * static_cast<float>(i) + 0.11f); }

}  // namespace

int main() {
    kvcache::model_shape shape;
    shape.n_layer = 2;
    shape.n_head_kv = 2;
    shape.head_dim_k = 64;
    shape.rope = {kvcache::rope_type::neox, 10000.0f, 1.0f, 0};
    shape.n_cells = 64;
    shape.n_seq_max = 2;
    const std::uint32_t n_head = 4;
    const std::uint32_t n = 10;

    using custom_t = kvcache::kv_cache<kvcache::f32, reversed>;
    using reference_t = kvcache::kv_cache<kvcache::f32>;
    custom_t custom(shape);
    reference_t reference(shape);

    std::vector<kvcache::pos_t> pos(n);
    std::vector<kvcache::seq_id_t> seq(n, 0);
    for (std::uint32_t i = 0; i < n; ++i) pos[i] = static_cast<kvcache::pos_t>(i);
    std::vector<float> k(n * shape.k_row_size()), v(n * shape.v_row_size()), q(n * n_head * shape.head_dim_k);
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = value(static_cast<std::uint32_t>(i));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = value(static_cast<std::uint32_t>(i + 7919));
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = value(static_cast<std::uint32_t>(i + 104729));
    kvcache::ops::rope_rows(k.data(), n, shape.n_head_kv, shape.head_dim_k, pos.data(), shape.rope);
    kvcache::ops::rope_rows(q.data(), n, n_head, shape.head_dim_k, pos.data(), shape.rope);

    // 1. Placement: the layout's plan is what place() returns.
    auto pc = custom.place(pos, seq);
    auto pr = reference.place(pos, seq);
    if (!pc || !pr) {
        std::printf("place failed\n");
        return 1;
    }
    for (std::uint32_t i = 0; i < n; ++i) expect(pc.value().cells[i] == shape.n_cells - 1 - i, "reversed placement");
    for (std::uint32_t l = 0; l < shape.n_layer; ++l) {
        custom.write_k(l, pc.value().cells, k.data());
        custom.write_v(l, pc.value().cells, v.data());
        reference.write_k(l, pr.value().cells, k.data());
        reference.write_v(l, pr.value().cells, v.data());
    }
    expect(custom.commit() == kvcache::tx_result::committed, "commit");
    static_cast<void>(reference.commit());

    // 2. Attention reads the layout through the tiled format: same result as contiguous.
    kvcache::ops::attention_workspace ws;
    std::vector<float> out_c(n * n_head * shape.dim_v()), out_r(out_c.size());
    auto attend = [&](const auto& cache, std::vector<float>& out, const std::vector<kvcache::pos_t>& qp) {
        for (std::uint32_t l = 0; l < shape.n_layer; ++l)
            kvcache::ops::attention(cache, l, q.data(), qp.data(), seq.data(), n, {.n_head = n_head}, out.data(), ws);
    };
    attend(custom, out_c, pos);
    attend(reference, out_r, pos);
    expect(max_diff(out_c, out_r) < 1e-5f, "attention equals the contiguous layout");

    // 3. K-shift: move sequence 0 by +5 in both caches and rotate K.
    custom.seq_add(0, 0, -1, 5).value();
    reference.seq_add(0, 0, -1, 5).value();
    kvcache::ops::apply_k_shift(custom);
    kvcache::ops::apply_k_shift(reference);
    expect(!custom.has_shift(), "K-shift applied");
    std::vector<kvcache::pos_t> moved(pos);
    for (auto& p : moved) p += 5;
    std::vector<float> row_c(shape.k_row_size()), row_r(shape.k_row_size());
    for (std::uint32_t i = 0; i < n; ++i) {
        custom.read_k(1, pc.value().cells[i], row_c.data());
        reference.read_k(1, pr.value().cells[i], row_r.data());
        expect(max_diff(row_c, row_r) < 1e-5f, "shifted K rows equal");
    }
    attend(custom, out_c, moved);
    attend(reference, out_r, moved);
    expect(max_diff(out_c, out_r) < 1e-5f, "attention after the K-shift equals the contiguous layout");

    // 4. Memory report through the held_cells capability: cells [54, 64) are held.
    const kvcache::ops::memory_usage m = kvcache::ops::memory(custom);
    expect(m.used_bytes == std::size_t{n} * custom.bytes_per_token(), "used bytes");
    expect(m.held_bytes == std::size_t{n} * custom.bytes_per_token(), "held bytes (top segment)");
    custom.seq_rm(0, 5, 7).value();  // leaves a hole: held stays [54, 64), used drops by 2
    reference.seq_rm(0, 5, 7).value();
    const kvcache::ops::memory_usage m2 = kvcache::ops::memory(custom);
    expect(m2.held_bytes - m2.used_bytes == 2 * custom.bytes_per_token(), "waste of the hole");

    // 5. State files: save, load into a fresh cache of the same layout (placed by the
    //    layout's plan again), and compare attention with the original.
    const std::vector<std::byte> bytes = kvcache::io::save_state(custom);
    custom_t loaded(shape);
    auto info = kvcache::io::load_state(loaded, bytes);
    expect(info.ok(), "load_state");
    expect(loaded.used() == custom.used() && loaded.seq_pos_max(0) == custom.seq_pos_max(0), "loaded cells");
    bool top = true;
    for (std::uint32_t c : loaded.cells().used_cells()) top = top && c >= shape.n_cells - loaded.used();
    expect(top, "loaded cells placed by the layout (top of the cache)");
    std::vector<float> out_l(out_c.size());
    attend(custom, out_c, moved);
    attend(loaded, out_l, moved);
    // The loaded cells hold other positions than the original's (saved cell order is
    // ascending, the plan fills top down), so compare each position's K and V exactly,
    // and attention up to the order of the float sums.
    auto cell_of = [](const auto& cache, kvcache::pos_t p) {
        for (std::uint32_t c : cache.cells().used_cells())
            if (cache.cells().pos(c) == p) return c;
        return ~std::uint32_t{0};
    };
    std::vector<float> vrow_c(shape.v_row_size()), vrow_l(shape.v_row_size());
    for (kvcache::pos_t p : moved) {
        const std::uint32_t a = cell_of(custom, p), b = cell_of(loaded, p);
        expect((a == ~std::uint32_t{0}) == (b == ~std::uint32_t{0}), "loaded positions");
        if (a == ~std::uint32_t{0} || b == ~std::uint32_t{0}) continue;
        for (std::uint32_t l = 0; l < shape.n_layer; ++l) {
            custom.read_k(l, a, row_c.data());
            loaded.read_k(l, b, row_r.data());
            custom.read_v(l, a, vrow_c.data());
            loaded.read_v(l, b, vrow_l.data());
            expect(row_c == row_r && vrow_c == vrow_l, "loaded K/V rows are bit-identical");
        }
    }
    expect(max_diff(out_c, out_l) < 1e-5f, "attention after save/load equals the original");

    // 6. A refusal leaves the cache unchanged: a batch larger than the free cells.
    std::vector<kvcache::pos_t> big(60);
    std::vector<kvcache::seq_id_t> big_seq(60, 1);
    for (std::uint32_t i = 0; i < 60; ++i) big[i] = static_cast<kvcache::pos_t>(i);
    const std::uint32_t used_before = custom.used();
    auto refused = custom.place(big, big_seq);
    expect(!refused && refused.code() == kvcache::errc::no_space && custom.used() == used_before,
           "no_space leaves the cache unchanged");

    std::printf("custom layout '%s': %s\n", reversed::name.data(), failures == 0 ? "all checks passed" : "FAILED");
    return failures == 0 ? 0 : 1;
}
