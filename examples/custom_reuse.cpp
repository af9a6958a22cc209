// A user-written reuse policy (kvcache::reuse_policy, kvcache/concepts.hpp): the
// slot manager asks it for every request's plan and executes exactly that plan.
//
// every_other_request reuses the longest common prefix on every second request
// only, and keeps at most max_keep positions; it records what it planned. The
// program serves four growing requests through a slot_manager and exits 0 only if
// what was reused is exactly what the policy planned.
#include <kvcache/kvcache.hpp>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <vector>

/// Required members (concepts.hpp): policy_kind, name, needs_shift, global_cache, plan().
struct every_other_request {
    using policy_kind = kvcache::reuse_tag;
    static constexpr std::string_view name = "every_other_request";
    static constexpr bool needs_shift = false;   // plans never move cells (no seq_add)
    static constexpr bool global_cache = false;  // no cross-slot prompt cache

    std::uint32_t max_keep = 24;          ///< keep at most this many positions
    std::uint32_t n_calls = 0;            ///< plans made so far
    std::vector<kvcache::reuse::plan> planned;  ///< every plan, in order

    /// Even calls: nothing. Odd calls: the LCP (reuse::make_plan, no chunk moves), cut to max_keep.
    kvcache::reuse::plan plan(const kvcache::prompt_tokens& cached, const kvcache::prompt_tokens& request,
                              const kvcache::reuse::plan_options& opt) {
        kvcache::reuse::plan p;
        p.n_request = static_cast<std::uint32_t>(request.size());
        if (n_calls++ % 2 == 1) {
            kvcache::reuse::plan_options o = opt;
            o.min_chunk = 0;
            p = kvcache::reuse::make_plan(cached, request, o);
            p.n_lcp = p.n_past = static_cast<std::uint32_t>(request.chunk_floor(std::min(p.n_past, max_keep)));
        }
        planned.push_back(p);
        return p;
    }
};
static_assert(kvcache::reuse_policy<every_other_request>);

using cache_t = kvcache::kv_cache<kvcache::f32, kvcache::contiguous<>, every_other_request>;

/// The host's part: compute request positions [from, to) into sequence seq (here: constant K/V).
void compute(cache_t& cache, kvcache::seq_id_t seq, std::uint32_t from, std::uint32_t to) {
    if (from >= to) return;
    std::vector<kvcache::pos_t> pos(to - from);
    std::iota(pos.begin(), pos.end(), static_cast<kvcache::pos_t>(from));
    std::vector<kvcache::seq_id_t> seqs(pos.size(), seq);
    kvcache::transaction tx(cache);
    auto placed = cache.place(pos, seqs).value();
    std::vector<float> k(pos.size() * cache.shape().k_row_size(), 0.5f);
    std::vector<float> v(pos.size() * cache.shape().v_row_size(), 0.25f);
    for (std::uint32_t layer = 0; layer < cache.shape().n_layer; ++layer) {
        cache.write_k(layer, placed.cells, k.data());
        cache.write_v(layer, placed.cells, v.data());
    }
    tx.commit();
}

int main() {
    kvcache::model_shape shape;
    shape.n_layer = 2;
    shape.n_head_kv = 1;
    shape.head_dim_k = 16;
    shape.n_cells = 256;
    shape.n_seq_max = 1;
    cache_t cache(shape);
    kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 1});

    std::vector<kvcache::token_t> text(20);
    std::iota(text.begin(), text.end(), 100);
    int failures = 0;
    for (int round = 0; round < 4; ++round) {
        text.insert(text.end(), {kvcache::token_t(1000 + round), kvcache::token_t(2000 + round)});
        const kvcache::prompt_tokens request{std::span<const kvcache::token_t>(text)};
        const auto p = slots.prepare(request).value();
        const kvcache::reuse::plan& want = slots.reuse_policy_object().planned.back();
        // What was reused is what the policy planned: the plan, the metrics and the cache agree.
        const bool ok = p.plan == want && p.n_past == want.n_past && p.metrics.from_slot == want.n_past &&
                        p.metrics.computed == p.n_request - want.n_past &&
                        cache.seq_pos_max(p.seq) == static_cast<kvcache::pos_t>(want.n_past) - 1;
        std::printf("request %d: %zu positions, planned n_past %u, reused %u, computed %u: %s\n", round,
                    request.size(), want.n_past, p.metrics.from_slot, p.metrics.computed, ok ? "ok" : "MISMATCH");
        failures += ok ? 0 : 1;
        compute(cache, p.seq, p.n_past, p.n_request);
        slots.commit_prompt(p.slot);
        slots.release(p.slot);
    }
    // Expected: requests 0 and 2 reuse nothing, 1 and 3 reuse min(LCP, 24) = 22 and 24.
    const auto& planned = slots.reuse_policy_object().planned;
    const bool alternation = planned.size() == 4 && planned[0].n_past == 0 && planned[1].n_past == 22 &&
                             planned[2].n_past == 0 && planned[3].n_past == 24;
    if (!alternation) std::printf("unexpected plans\n");
    return failures == 0 && alternation ? 0 : 1;
}
