// Fault injection for the prompt cache and the slot manager (issue 25): every mutating
// host entry point (slot_manager prepare / commit_prompt / save_checkpoint / release /
// clear_slot, prompt_cache save / load / erase / evict_one / drop_invalid) runs with an
// operator new that throws std::bad_alloc at the N-th allocation, N = 1, 2, ... until it
// completes (under the sanitizers every third N past the 64th: fi::next_n), on the contiguous and the paged layout with copy_store and shared_store
// entries.
// Every operation is strong: after each throw everything is as it was before the call
// (fip_observe: the cache's cell metadata, indexes, block tables, refcounts, the K/V
// bytes of every occupied cell (and, but for prepare, of the free ones too), recurrent
// states; every slot: tokens, busy, checkpoints; the global cache: entries, their
// eviction stats and order, the radix index node by node, the remembered evicted keys
// and their index, the store's free sequence ids; every counter), and the same call, run
// again, gives what it gives on an untouched twin. prepare and release run under the
// slot manager's undo journal; they are swept on contiguous, paged, ring, ISWA and
// hybrid memories, with chunk reuse (K-shift), checkpoints and a storage tier. The
// compound check (fip_check_consistent: nothing served wrong) remains for a sweep that
// asks for it.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/layout/paged.hpp>
#include <kvcache/tier/tier_cache.hpp>

#include <algorithm>
#include <functional>
#include <iterator>
#include <map>
#include <new>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>

#include "prompt/toy_model.hpp"
#include "support/fault_alloc.hpp"  // the counting operator new (this file is its only user here)
#include "support/memory_snapshot.hpp"

namespace fi = kvtest::fi;
using namespace kvcache;

namespace {

using contig_g = kv_cache<f32, contiguous<>, reuse::global<>>;
using paged_g = kv_cache<f32, paged<32>, reuse::global<>>;

/// FNV-1a over raw bytes.
std::uint64_t fip_hash(const void* data, std::size_t n, std::uint64_t h = 1469598103934665603ull) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

/// The raw K/V bytes of every cell of every layer, free cells included (one hash per layer and K / V).
template <class Cache>
std::string fip_raw(const Cache& cache) {
    std::ostringstream os;
    std::vector<typename Cache::storage_type> bytes;
    for (std::uint32_t layer = 0; layer < cache.shape().n_layer; ++layer)
        for (bool v : {false, true}) {
            std::uint64_t h = 1469598103934665603ull;
            for (std::uint32_t c = 0; c < cache.capacity(); ++c) {
                cache.storage().cell_bytes(layer, c, v, bytes);
                h = fip_hash(bytes.data(), bytes.size() * sizeof(bytes[0]), h);
            }
            os << "raw layer " << layer << (v ? " V " : " K ") << h << '\n';
        }
    return os.str();
}

/// Everything a host can observe of the cache, the slots and the global cache: the memory
/// snapshot (metadata, indexes, occupied cells' K/V, block tables, refcounts), the raw K/V
/// bytes of every cell (free ones too), every slot, the global cache's entries with their
/// eviction stats and order, its radix index node by node, the remembered evicted keys and
/// their index, the store's free sequence ids (shared_store) and every counter.
template <class Cache, class Slots>
std::string fip_observe(const Cache& cache, Slots& slots, bool free_bytes = true) {
    std::ostringstream os;
    if constexpr (requires { cache.recurrent(); }) {  // hybrid_memory: both parts
        for (const auto& line : kvtest::snapshot(cache.attention()).lines) os << line << '\n';
        const recurrent_memory& r = cache.recurrent();
        for (seq_id_t q = 0; static_cast<std::uint32_t>(q) < r.n_seq_max(); ++q) {
            const auto st = r.seq_state(q);
            os << "recurrent seq " << q << " [" << r.seq_pos_min(q) << ", " << r.seq_pos_max(q) << "] state "
               << fip_hash(st.data(), st.size_bytes()) << '\n';
        }
    } else {
        for (const auto& line : kvtest::snapshot(cache).lines) os << line << '\n';
    }
    if constexpr (requires { cache.storage(); })
        if (free_bytes) os << fip_raw(cache);
    for (std::uint32_t i = 0; i < slots.n_slots(); ++i) {
        const int id = static_cast<int>(i);
        os << "slot " << i << (slots.busy(id) ? " busy" : " idle") << " ck";
        for (const auto& [lo, hi] : slots.checkpoint_spans(id)) os << " [" << lo << ", " << hi << "]";
        os << " tokens";
        for (std::size_t t = 0; t < slots.tokens(id).size(); ++t) os << ' ' << slots.tokens(id)[t];
        os << '\n';
    }
    auto& g = slots.global_cache();
    os << "global " << g.size() << " entries, " << g.bytes() << " bytes, " << g.n_tokens() << " tokens:";
    for (auto id : g.ids()) os << ' ' << id;
    os << '\n';
    for (auto id : g.ids()) {
        const entry_stats* st = g.stats_of(id);
        os << "entry " << id << " last_use " << st->last_use << " hits " << st->hits << " priority " << st->priority
           << " tokens";
        for (std::size_t t = 0; t < g.tokens_of(id)->size(); ++t) os << ' ' << (*g.tokens_of(id))[t];
        os << " checkpoints";
        for (const auto& [lo, hi] : g.checkpoint_spans_of(id)) os << " [" << lo << ", " << hi << "]";
        os << '\n';
    }
    os << "eviction order:";
    for (auto id : g.eviction_order()) os << ' ' << id;
    os << '\n';
    auto index = [&os](const char* tag, const radix_index& x) {
        os << tag << ' ' << x.size() << " entries " << x.node_count() << " nodes\n";
        x.for_each_node([&](std::uint64_t salt, std::uint32_t depth, std::span<const key_symbol> label,
                            const radix_index::entry_id* e) {
            os << tag << " node salt " << salt << " depth " << depth << " label " << fip_hash(label.data(), label.size_bytes())
               << " entry " << (e ? std::to_string(*e) : std::string("-")) << '\n';
        });
    };
    index("index", g.index());
    index("evicted index", g.evicted_index());
    g.for_each_evicted([&](std::uint64_t salt, std::span<const key_symbol> key) {
        os << "evicted salt " << salt << " key " << key.size() << ' ' << fip_hash(key.data(), key.size_bytes()) << '\n';
    });
    if constexpr (requires { g.store().free_ids(); }) {
        os << "store free:";
        for (auto s : g.store().free_ids()) os << ' ' << s;
        os << '\n';
    }
    os << to_prometheus(slots.metrics());
    return os.str();
}

/// One request as a host runs it (prepare, compute the rest, one generated token, release).
template <class Slots, class Cache>
void fip_request(Slots& slots, Cache& cache, const prompt_tokens& req, int slot_id) {
    request_options ro;
    ro.slot_id = slot_id;
    auto p = slots.prepare(req, ro);
    if (!p) throw std::logic_error("fault injection fixture: prepare refused: " + p.message());
    toy::fill(cache, p.value().seq, req, p.value().n_past, p.value().n_request);
    slots.commit_prompt(p.value().slot);
    prompt_tokens next = slots.tokens(p.value().slot);
    next.push_back(90000);
    toy::fill(cache, p.value().seq, next, next.size() - 1, next.size());
    slots.append(p.value().slot, 90000);
    slots.release(p.value().slot);
}

const prompt_tokens fip_a = toy::text(40, 1000);
const prompt_tokens fip_b = toy::text(24, 3000);

/// A cache and slot manager with history: slot 0 idle with a + 1 (also a global entry),
/// slot 1 idle with b + 1 (entry too), slot 2 empty. Paged: 4 blocks of 32 cells, all of
/// them used once `tight` adds a third request, so a new prompt needs eviction.
template <class Cache, class Store>
struct fip_world {
    Cache cache;
    slot_manager<Cache, Store> slots;
    static Store make_store() {
        if constexpr (std::is_same_v<Store, shared_store<Cache>>) return Store(3, 5);  // sequences 3..7 (8: checks)
        else return Store{};
    }
    explicit fip_world(bool tight, bool strong = true)
        : cache(toy::shape(tight ? 128u : 256u, 9)),
          slots(cache,
                [strong] {
                    slot_options o;
                    o.n_slots = 3;
                    o.strong_prepare = strong;
                    return o;
                }(),
                make_store()) {
        fip_request(slots, cache, fip_a, 0);
        fip_request(slots, cache, fip_b, 1);
    }
};

long fip_total_throws = 0;

/// After a compound operation threw: nothing a later request could be served is wrong.
template <class Cache, class Store>
void fip_check_consistent(fip_world<Cache, Store>& w, const std::vector<bool>& busy_before) {
    if constexpr (requires { w.cache.storage().check_invariants(w.cache.cells()); })
        REQUIRE(w.cache.storage().check_invariants(w.cache.cells()) == "");
    for (std::uint32_t i = 0; i < w.slots.n_slots(); ++i) {
        const int id = static_cast<int>(i);
        REQUIRE(w.slots.busy(id) == busy_before[i]);
        const prompt_tokens& held = w.slots.tokens(id);
        if (!busy_before[i] && !held.empty()) {  // an idle slot's state is served as is by the next prepare
            CAPTURE(i);
            REQUIRE(toy::max_error(w.cache, w.slots.seq_of(id), held, held.size()) == 0.0);
        }
    }
    auto& g = w.slots.global_cache();
    for (auto eid : g.ids()) {
        const prompt_tokens toks = *g.tokens_of(eid);
        if (!g.valid(w.cache, eid)) continue;  // dropped, never served, by the next prepare
        auto r = g.load(w.cache, 8, eid);
        if (!r) continue;  // refused (no room): a miss, not a wrong hit
        CAPTURE(eid);
        REQUIRE(toy::max_error(w.cache, 8, toks, toks.size()) == 0.0);
        REQUIRE(w.cache.seq_rm(8, -1, -1));
    }
    // the next requests are served exactly (fip_request checks nothing itself: check here)
    for (int slot = 0; slot < 3; ++slot)
        if (!w.slots.busy(slot)) {
            const prompt_tokens next = toy::cat(fip_a, toy::text(5, 8000));
            request_options ro;
            ro.slot_id = slot;
            auto p = w.slots.prepare(next, ro);
            REQUIRE_MESSAGE(p.ok(), p.message());
            toy::fill(w.cache, p.value().seq, next, p.value().n_past, p.value().n_request);
            w.slots.commit_prompt(slot);
            REQUIRE(toy::max_error(w.cache, p.value().seq, next, next.size()) == 0.0);
            w.slots.release(slot);
            break;
        }
}

/// Runs f with the n-th allocation failing; whether it threw std::bad_alloc.
template <class F>
bool fip_armed(long n, F&& f) {
    fi::arm(n);
    try {
        f();
    } catch (const std::bad_alloc&) {
        fi::disarm();
        return true;
    } catch (...) {
        fi::disarm();
        throw;
    }
    fi::disarm();
    return false;
}

/// The first line where two observations differ (doctest would print both whole).
std::string fip_first_diff(const std::string& a, const std::string& b) {
    std::istringstream x(a), y(b);
    std::string lx, ly;
    for (int i = 0;; ++i) {
        const bool gx = static_cast<bool>(std::getline(x, lx)), gy = static_cast<bool>(std::getline(y, ly));
        if (!gx && !gy) return "";
        if (!gx || !gy || lx != ly)
            return "line " + std::to_string(i) + ": [" + (gx ? lx : "<none>") + "] vs [" + (gy ? ly : "<none>") + "]";
    }
}

template <class Cache, class Store>
void fip_sweep(const std::string& name, bool tight, bool strict,
               const std::function<std::string(fip_world<Cache, Store>&)>& op,
               const std::function<void(fip_world<Cache, Store>&)>& prep = {}, bool free_bytes = true);

/// Sweeps N = 1, 2, ... for `op` on fresh worlds; `prep` runs unarmed on each first.
/// (A world other than fip_world is swept strictly only.) What each run is compared with
/// comes from one untouched twin built per sweep (worlds built alike are alike, and run 1
/// checks it): its observation as the call finds it, then the call's result and the
/// observation after it, unarmed. A twin built per N took half the sweep's time (most of
/// it allocation under ASan).
template <class World>
void fip_sweep_world(const std::string& name, bool tight, bool strict, const std::function<std::string(World&)>& op,
                     const std::function<void(World&)>& prep = {}, bool free_bytes = true) {
    CAPTURE(name);
    World twin(tight);
    if (prep) prep(twin);
    const std::string before = fip_observe(twin.cache, twin.slots, free_bytes);
    std::vector<bool> busy_before;
    for (std::uint32_t i = 0; i < twin.slots.n_slots(); ++i)
        busy_before.push_back(twin.slots.busy(static_cast<int>(i)));
    const std::string want = op(twin);
    const std::string want_after = fip_observe(twin.cache, twin.slots);
    int throws = 0;
    std::string last;
    for (long n = 1;; n = fi::next_n(n)) {
        CAPTURE(n);
        World w(tight);
        if (prep) prep(w);
        if (n == 1) REQUIRE(fip_first_diff(before, fip_observe(w.cache, w.slots, free_bytes)) == "");  // built alike
        std::string got;
        const long injected = fi::injected.load();
        const bool threw = fip_armed(n, [&] { got = op(w); });
        if (!threw) {
            last = got;
            CHECK(got == want);
            CHECK(fip_first_diff(fip_observe(w.cache, w.slots), want_after) == "");
            // A failure a fallback absorbed (fi::disarm_fired): the points after it remain.
            if (fi::injected.load() != injected) continue;
            break;
        }
        ++throws;
        if (!strict) {
            if constexpr (requires { fip_check_consistent(w, busy_before); }) {
                fip_check_consistent(w, busy_before);
            } else {
                FAIL("only fip_world is swept without strict");
            }
            REQUIRE(n < 100000);
            continue;
        }
        REQUIRE(fip_first_diff(before, fip_observe(w.cache, w.slots, free_bytes)) == "");
        // the call completes afterwards, as on the untouched twin
        const std::string again = op(w);
        REQUIRE(again == want);
        REQUIRE(fip_first_diff(fip_observe(w.cache, w.slots), want_after) == "");
        REQUIRE(n < 100000);
    }
    fip_total_throws += throws;
    const std::string what = strict ? "each left everything as it was" : "after each nothing was served wrong";
    const std::string line = name + ": " + std::to_string(throws) + " injected failures, " + what + " (result: " + last + ")";
    MESSAGE(line);
}

template <class Cache, class Store>
void fip_sweep(const std::string& name, bool tight, bool strict,
               const std::function<std::string(fip_world<Cache, Store>&)>& op,
               const std::function<void(fip_world<Cache, Store>&)>& prep, bool free_bytes) {
    fip_sweep_world<fip_world<Cache, Store>>(name, tight, strict, op, prep, free_bytes);
}

template <class R>
std::string fip_describe(const R& r) {
    return r ? std::string("ok") : "error " + std::to_string(static_cast<int>(r.code()));
}

template <class Cache, class Store>
void fip_sweep_all(bool tight) {
    using world = fip_world<Cache, Store>;
    const prompt_tokens grown = toy::cat(fip_a, toy::text(3, 7000));
    const prompt_tokens fresh = toy::text(50, 5000);
    auto prepare = [](const prompt_tokens& req, int slot_id) {
        return [req, slot_id](world& w) {
            request_options ro;
            ro.slot_id = slot_id;
            auto p = w.slots.prepare(req, ro);
            fi::disarm();  // the call is over: describing its result may allocate
            if (!p) return fip_describe(p);
            return "n_past " + std::to_string(p.value().n_past) + " slot " + std::to_string(p.value().slot);
        };
    };
    // prepare is strong on kv_cache: bit-identical, but for the bytes of free cells (which
    // hold nothing: a placement or load it undid may have written them).
    fip_sweep<Cache, Store>("prepare: exact repeat from the slot", tight, true, prepare(fip_a, -1), {}, false);
    fip_sweep<Cache, Store>("prepare: growing prompt from the global cache into slot 2", tight, true, prepare(grown, 2), {},
                            false);
    fip_sweep<Cache, Store>("prepare: a new prompt (room made by eviction when tight)", tight, true, prepare(fresh, 2), {},
                            false);
    // Another tenant's entry into slot 0: slot 0's own state (tenant 0) is dropped and the
    // entry is loaded into the cells that freed (copy_store writes K/V there); a throw
    // after that (making room for the 40 new positions evicts slot 2's state when tight)
    // must bring slot 0's K/V back (the byte guard). A host seq_rm under slot 1 also makes
    // prepare drop slot 1's state first (its cells changed).
    const prompt_tokens other = toy::text(20, 11000);
    auto tenant7 = [other](world& w) {
        request_options ro;
        ro.slot_id = 2;
        ro.salt = 7;
        auto p = w.slots.prepare(other, ro).value();
        toy::fill(w.cache, p.seq, other, p.n_past, p.n_request);
        w.slots.commit_prompt(2);
        w.slots.release(2);  // tight (paged): no free block is left
        static_cast<void>(w.cache.seq_rm(w.slots.seq_of(1), 20, -1));  // slot 1's cells change under it
    };
    fip_sweep<Cache, Store>(
        "prepare: another tenant's entry into slot 0 (its cells freed and written again)", tight, true,
        [other](world& w) {
            request_options ro;
            ro.slot_id = 0;
            ro.salt = 7;
            auto p = w.slots.prepare(toy::cat(other, toy::text(40, 12000)), ro);  // tight: room made after the load
            fi::disarm();
            if (!p) return fip_describe(p);
            return "n_past " + std::to_string(p.value().n_past) + " global " + std::to_string(p.value().metrics.from_global);
        },
        tenant7, false);
    auto prepared = [fresh](world& w) {
        request_options ro;
        ro.slot_id = 2;
        auto p = w.slots.prepare(fresh, ro).value();
        toy::fill(w.cache, p.seq, fresh, p.n_past, p.n_request);
    };
    fip_sweep<Cache, Store>(
        "commit_prompt", tight, true,
        [](world& w) {
            w.slots.commit_prompt(2);
            return std::string("ok");
        },
        prepared);
    fip_sweep<Cache, Store>(
        "save_checkpoint", tight, true,
        [](world& w) {
            auto r = w.slots.save_checkpoint(2);
            fi::disarm();
            return fip_describe(r);
        },
        [prepared](world& w) {
            prepared(w);
            w.slots.commit_prompt(2);
        });
    fip_sweep<Cache, Store>(
        "release (saves into the global cache)", tight, true,
        [](world& w) {
            w.slots.release(2);
            return std::string("ok");
        },
        [prepared](world& w) {
            prepared(w);
            w.slots.commit_prompt(2);
        });
    fip_sweep<Cache, Store>(
        "release with an uncommitted token (removed first)", tight, true,
        [](world& w) {
            w.slots.release(2);
            return std::string("ok");
        },
        [prepared, fresh](world& w) {
            prepared(w);
            w.slots.commit_prompt(2);
            prompt_tokens next = fresh;
            next.push_back(90001);
            toy::fill(w.cache, w.slots.seq_of(2), next, next.size() - 1, next.size());  // never appended
        });
    fip_sweep<Cache, Store>(
        "release after the host changed the slot's cells (its state dropped)", tight, true,
        [](world& w) {
            w.slots.release(2);
            return std::to_string(w.slots.tokens(2).size());
        },
        [prepared](world& w) {
            prepared(w);
            w.slots.commit_prompt(2);
            static_cast<void>(w.cache.seq_rm(w.slots.seq_of(2), 5, 10));  // a hole: the slot's state cannot be served
        });
    fip_sweep<Cache, Store>("clear_slot", tight, true, [](world& w) {
        w.slots.clear_slot(0);
        return std::string("ok");
    });
    fip_sweep<Cache, Store>("prompt_cache::load into an empty sequence", tight, true, [](world& w) {
        auto& g = w.slots.global_cache();
        const auto id = g.ids().front();
        auto r = g.load(w.cache, 8, id);
        fi::disarm();
        return fip_describe(r);
    });
    fip_sweep<Cache, Store>("prompt_cache::save of slot 1's sequence", tight, true, [](world& w) {
        auto r = w.slots.global_cache().save(w.cache, 1, w.slots.tokens(1));
        fi::disarm();
        return r ? "saved " + std::to_string(*r) : std::string("not saved");
    });
    fip_sweep<Cache, Store>(
        "prompt_cache::save as a new tenant, evicting by the token limit", tight, true,
        [](world& w) {
            auto r = w.slots.global_cache().save(w.cache, 1, w.slots.tokens(1), {.salt = 7});
            fi::disarm();
            return r ? "saved " + std::to_string(*r) : std::string("not saved");
        },
        [](world& w) {
            prompt_cache_limits l;
            l.limit_bytes = 0;
            l.limit_tokens = 70;  // the two entries (41 + 25 tokens) fit; a third evicts
            w.slots.global_cache().set_limits(w.cache, l);
        });
    fip_sweep<Cache, Store>(
        "prompt_cache::save of a longer prompt (its prefix entry is dropped)", tight, true,
        [](world& w) {
            const prompt_tokens longer = toy::cat(w.slots.tokens(1), toy::text(3, 9000));
            auto r = w.slots.global_cache().save(w.cache, 1, longer);
            fi::disarm();
            return r ? "saved " + std::to_string(*r) : std::string("not saved");
        },
        [](world& w) {  // the host computes 3 more positions into slot 1's sequence
            const prompt_tokens longer = toy::cat(w.slots.tokens(1), toy::text(3, 9000));
            toy::fill(w.cache, 1, longer, w.slots.tokens(1).size(), longer.size());
        });
    fip_sweep<Cache, Store>("prompt_cache::set_limits evicting by the token limit", tight, true, [](world& w) {
        prompt_cache_limits l;
        l.limit_bytes = 0;
        l.limit_tokens = 30;  // the two entries (41 + 25 tokens) do not fit: the older goes
        w.slots.global_cache().set_limits(w.cache, l);
        return std::string("ok");
    });
    fip_sweep<Cache, Store>(
        "prompt_cache::set_pinned: unpinning evicts by the token limit", tight, true,
        [](world& w) {
            auto& g = w.slots.global_cache();
            const bool known = g.set_pinned(w.cache, g.ids().front(), false);
            fi::disarm();
            return std::string(known ? "unpinned, " : "unknown, ") + std::to_string(g.ids().size()) + " entries";
        },
        [](world& w) {
            auto& g = w.slots.global_cache();
            for (const auto id : g.ids()) g.set_pinned(w.cache, id, true);
            prompt_cache_limits l;
            l.limit_bytes = 0;
            l.limit_tokens = 30;  // the two entries (41 + 25 tokens) do not fit, but both are pinned
            g.set_limits(w.cache, l);
        });
    fip_sweep<Cache, Store>("prompt_cache::clear", tight, true, [](world& w) {
        w.slots.global_cache().clear(w.cache);
        return std::string("ok");
    });
    fip_sweep<Cache, Store>("prompt_cache::erase", tight, true, [](world& w) {
        auto& g = w.slots.global_cache();
        const auto id = g.ids().back();
        const bool erased = g.erase(w.cache, id);
        fi::disarm();
        return std::string(erased ? "erased" : "kept");
    });
    fip_sweep<Cache, Store>("prompt_cache::evict_one", tight, true, [](world& w) {
        const bool evicted = w.slots.global_cache().evict_one(w.cache);
        fi::disarm();
        return std::string(evicted ? "evicted" : "none");
    });
    fip_sweep<Cache, Store>(
        "prompt_cache::drop_invalid after a host seq_rm", tight, true,
        [](world& w) {
            const auto n = w.slots.global_cache().drop_invalid(w.cache).n;
            fi::disarm();
            return std::to_string(n);
        },
        [](world& w) { static_cast<void>(w.cache.seq_rm(-1, 30, -1)); });  // every sequence: entries too
}

}  // namespace

TEST_CASE("fault injection: slots and prompt cache, contiguous, copy_store") {
    fip_sweep_all<contig_g, copy_store<contig_g>>(false);
}
TEST_CASE("fault injection: slots and prompt cache, paged, copy_store, no free block") {
    fip_sweep_all<paged_g, copy_store<paged_g>>(true);
}
TEST_CASE("fault injection: slots and prompt cache, paged, shared_store") {
    fip_sweep_all<paged_g, shared_store<paged_g>>(false);
}

namespace {
/// A request as a host runs it on a memory with checkpoints: prepare, compute(from, to,
/// checkpoints) (saving the listed checkpoints), commit_prompt, release.
template <class Slots, class Compute>
void fip_serve(Slots& slots, const prompt_tokens& req, int slot, Compute&& compute) {
    request_options ro;
    ro.slot_id = slot;
    auto p = slots.prepare(req, ro).value();
    compute(std::size_t{p.n_past}, std::size_t{p.n_request}, p.checkpoints);
    slots.commit_prompt(slot);
    slots.release(slot);
}
}  // namespace

namespace {
// Memories with a sliding window (F23): a ring<8> kv_cache (copy_store entries) and an
// iswa_cache (full layers beside a ring; state_store entries), the slots saving
// checkpoints where prepare lists them. prepare re-enters a window, restores a checkpoint
// (a copy loaded into the cells of the slot's own region, which held its state), loads a
// global entry with its checkpoints: each strong.
constexpr std::uint32_t fw_w = 8;
using ring_g = kv_cache<f32, ring<fw_w>, reuse::global<>>;
using iswa_g = iswa_cache<fw_w, f32, reuse::global<>>;

model_shape fw_shape(std::uint32_t n_layer, std::uint32_t n_cells) {
    model_shape s = toy::shape(n_cells, 9);
    s.n_layer = n_layer;
    return s;
}
ring_g fw_make(std::type_identity<ring_g>) { return ring_g(fw_shape(2, ring<fw_w>::cells_for(9, 4))); }
iswa_g fw_make(std::type_identity<iswa_g>) {
    iswa_shape s;
    s.shape = fw_shape(4, 512);
    s.swa_layers = iswa_shape::every_nth_full(4, 2);
    s.swa_n_cells = ring<fw_w>::cells_for(9, 4);
    return iswa_g(s);
}
const model_shape& fw_model(const ring_g& c) { return c.shape(); }
const model_shape& fw_model(const iswa_g& c) { return c.full().shape(); }
std::uint32_t fw_layers(const ring_g& c) { return c.shape().n_layer; }
std::uint32_t fw_layers(const iswa_g& c) { return c.n_layer(); }

/// Computes positions [from, to) of p into seq one at a time (the ring's region takes a
/// few per batch), saving a checkpoint of the slot where `at` lists one.
template <class Cache, class Slots>
void fw_fill(Cache& c, Slots& slots, int slot, const prompt_tokens& p, std::size_t from, std::size_t to,
             const std::vector<std::uint32_t>& at) {
    const model_shape& sh = fw_model(c);
    const seq_id_t s = slots.seq_of(slot);
    const auto ks = toy::keys(p, false);
    for (std::size_t i = from; i < to; ++i) {
        const pos_t pos[1] = {static_cast<pos_t>(i)};
        const seq_id_t seq[1] = {s};
        auto r = c.place(pos, seq);
        REQUIRE(r);
        const toy::rows rows = toy::compute(sh, ks[i], static_cast<pos_t>(i));
        for (std::uint32_t l = 0; l < fw_layers(c); ++l) {
            const std::uint32_t ml = l % sh.n_layer;
            if constexpr (std::same_as<Cache, iswa_g>) {
                c.write_k(l, r.value(), rows.k[ml].data());
                c.write_v(l, r.value(), rows.v[ml].data());
            } else {
                c.write_k(l, r.value().cells, rows.k[ml].data());
                c.write_v(l, r.value().cells, rows.v[ml].data());
            }
        }
        REQUIRE(c.commit() == tx_result::committed);
        if (std::find(at.begin(), at.end(), static_cast<std::uint32_t>(i + 1)) != at.end())
            REQUIRE(slots.save_checkpoint(slot));
    }
}

template <class Cache, class Store>
struct fw_world {
    Cache cache;
    slot_manager<Cache, Store> slots;
    static slot_options options() {
        slot_options o;
        o.n_slots = 3;
        o.n_swa = fw_w;
        o.checkpoint_every = 8;
        return o;
    }
    explicit fw_world(bool) : cache(fw_make(std::type_identity<Cache>{})), slots(cache, options()) {
        request(fip_a, 0);
        request(fip_b, 1);
    }
    void request(const prompt_tokens& req, int slot) {
        fip_serve(slots, req, slot, [&](std::size_t from, std::size_t to, const std::vector<std::uint32_t>& at) {
            fw_fill(cache, slots, slot, req, from, to, at);
        });
    }
};

template <class Cache, class Store>
void fw_sweep_all() {
    using world = fw_world<Cache, Store>;
    auto prepare = [](const prompt_tokens& req, int slot_id) {
        return [req, slot_id](world& w) {
            request_options ro;
            ro.slot_id = slot_id;
            auto p = w.slots.prepare(req, ro);
            fi::disarm();
            if (!p) return fip_describe(p);
            const request_metrics& m = p.value().metrics;
            return "n_past " + std::to_string(p.value().n_past) + " slot " + std::to_string(p.value().slot) + " global " +
                   std::to_string(m.from_global) + " checkpoint " + std::to_string(m.checkpoint_restored);
        };
    };
    const prompt_tokens diverging = toy::cat(toy::text(20, 1000), toy::text(10, 5000));  // fip_a's first 20, then new
    fip_sweep_world<world>("window: exact repeat re-enters the slot's window", false, true, prepare(fip_a, 0), {}, false);
    fip_sweep_world<world>("window: a request diverging at 20 restores the slot's checkpoint", false, true,
                           prepare(diverging, 0), {}, false);
    fip_sweep_world<world>("window: the global entry of fip_a with its checkpoints, into slot 2", false, true,
                           prepare(diverging, 2), {}, false);
    {  // the scenarios do what they say
        world w(false);
        request_options ro;
        ro.slot_id = 0;
        const prompt_tokens& a = fip_a;
        CHECK(w.slots.prepare(a, ro).value().n_past == a.size() - 1);
        w.slots.release(0);
        auto p = w.slots.prepare(diverging, ro).value();
        CHECK(p.metrics.checkpoint_restored);
        CHECK(p.n_past == 16);
        w.slots.release(0);
        ro.slot_id = 2;
        auto q = w.slots.prepare(diverging, ro).value();
        CHECK(q.metrics.from_global > 0);
    }
}
}  // namespace

TEST_CASE("fault injection: prepare on a ring layout with checkpoints (copy_store) is strong") {
    fw_sweep_all<ring_g, copy_store<ring_g>>();
}
TEST_CASE("fault injection: prepare on an iswa_cache with checkpoints (state_store) is strong") {
    fw_sweep_all<iswa_g, state_store<iswa_g>>();
}

namespace {
/// A contiguous cache whose only copy of fip_a is in a memory tier under the slots: the
/// slot and the global cache forgot it.
struct ft_world {
    tier::tier_cache<contig_g, tier::memory_tier> chain{{.block_tokens = 16}, tier::memory_tier()};
    contig_g cache;
    slot_manager<contig_g, copy_store<contig_g>> slots;
    explicit ft_world(bool)
        : cache(toy::shape(256, 9)), slots(cache, [] {
              slot_options o;
              o.n_slots = 3;
              return o;
          }()) {
        slots.attach_tiers(chain, {.scratch_seq = 6});
        fip_request(slots, cache, fip_a, 0);  // published to the tier on release
        fip_request(slots, cache, fip_b, 1);
        slots.clear_slot(0);
        slots.global_cache().clear(cache);
    }
};
}  // namespace

TEST_CASE("fault injection: prepare served from a storage tier is strong") {
    const prompt_tokens longer = toy::cat(fip_a, toy::text(3, 7000));
    auto op = [longer](ft_world& w) {
        request_options ro;
        ro.slot_id = 2;
        auto p = w.slots.prepare(longer, ro);
        fi::disarm();
        if (!p) return fip_describe(p);
        return "n_past " + std::to_string(p.value().n_past) + " tier " + std::to_string(p.value().metrics.from_tier);
    };
    {
        ft_world w(false);
        request_options ro;
        ro.slot_id = 2;
        CHECK(w.slots.prepare(longer, ro).value().metrics.from_tier > 0);
    }
    // A failure inside the tier fetch is absorbed (a miss, tier_fetch_errors: prepare
    // completes, serving what the slot and global cache kept); any other leaves everything
    // as it was. The tiers' own counters count the fetches of failed calls: not compared.
    long throws = 0, absorbed = 0;
    for (long n = 1;; n = fi::next_n(n)) {
        CAPTURE(n);
        ft_world w(false);
        const std::string before = fip_observe(w.cache, w.slots, false);
        const long injected = fi::injected.load();
        std::string got;
        const bool threw = fip_armed(n, [&] { got = op(w); });
        if (threw) {
            ++throws;
            REQUIRE(fip_first_diff(before, fip_observe(w.cache, w.slots, false)) == "");
            continue;
        }
        if (fi::injected.load() != injected) {  // absorbed: the request is served from what prepare kept
            ++absorbed;
            REQUIRE(w.slots.metrics().tier_fetch_errors == 1);
            REQUIRE(toy::max_error(w.cache, w.slots.seq_of(2), longer, w.cache.seq_pos_max(w.slots.seq_of(2)) + 1) == 0.0);
            continue;
        }
        ft_world twin(false);  // built only for the completing run
        CHECK(got == op(twin));
        CHECK(fip_first_diff(fip_observe(w.cache, w.slots, false), fip_observe(twin.cache, twin.slots, false)) == "");
        break;
    }
    CHECK(throws > 0);
    fip_total_throws += throws;
    MESSAGE("prepare: a prefix from the memory tier: " << throws << " injected failures left everything as it was, "
                                                          << absorbed << " absorbed by the tier fetch (a miss)");
}

namespace {
// A hybrid memory (recurrent layers beside attention layers; state_store entries): the
// slots resume from checkpoints (whole-sequence states), which prepare loads over the
// slot's own state; the recurrent states come back through the recurrent guard.
using hyb_g = hybrid_memory<kv_cache<f32, reuse::global<>>>;

hyb_g fh_make() {
    recurrent_shape r;
    r.n_layer = 2;
    r.n_seq_max = 9;
    r.d_conv = 3;
    r.d_inner = 4;
    r.ssm_size = 5;
    model_shape a = toy::shape(512, 9);
    a.n_layer = 1;
    return hyb_g(a, r, {true, false, true});
}

/// Tokens [from, to) of p into seq (attention rows a function of token and position; the
/// recurrent state of every token so far), saving a checkpoint where `at` lists one.
template <class Slots>
void fh_fill(hyb_g& mem, Slots& slots, int slot, const prompt_tokens& p, std::size_t from, std::size_t to,
             const std::vector<std::uint32_t>& at) {
    const seq_id_t seq = slots.seq_of(slot);
    const model_shape& sh = mem.attention().shape();
    for (std::size_t i = from; i < to; ++i) {
        const pos_t pos[1] = {static_cast<pos_t>(i)};
        const seq_id_t seqs[1] = {seq};
        kvcache::transaction tx(mem);
        auto placed = mem.place(pos, seqs).value();
        const toy::rows rows = toy::compute(sh, toy::keys(p, false)[i], static_cast<pos_t>(i));
        for (std::uint32_t l = 0; l < mem.n_layer(); ++l) {
            if (mem.is_recurrent(l)) {
                auto conv = mem.conv_state(l, seq);
                auto ssm = mem.ssm_state(l, seq);
                const float x = static_cast<float>(p[i] % 97) * 0.01f + static_cast<float>(l);
                for (std::size_t k = 0; k < conv.size(); ++k) conv[k] = conv[k] * 0.5f + x;
                for (std::size_t k = 0; k < ssm.size(); ++k) ssm[k] = ssm[k] * 0.75f + x * static_cast<float>(k + 1);
            } else {
                mem.write_k(l, placed, rows.k[0].data());
                mem.write_v(l, placed, rows.v[0].data());
            }
        }
        tx.commit();
        if (std::find(at.begin(), at.end(), static_cast<std::uint32_t>(i + 1)) != at.end())
            REQUIRE(slots.save_checkpoint(slot));
    }
}

struct fh_world {
    hyb_g cache;
    slot_manager<hyb_g, state_store<hyb_g>> slots;
    explicit fh_world(bool) : cache(fh_make()), slots(cache, [] {
        slot_options o;
        o.n_slots = 3;
        o.checkpoint_every = 8;
        return o;
    }()) {
        request(fip_a, 0);
        request(fip_b, 1);
    }
    void request(const prompt_tokens& req, int slot) {
        fip_serve(slots, req, slot, [&](std::size_t from, std::size_t to, const std::vector<std::uint32_t>& at) {
            fh_fill(cache, slots, slot, req, from, to, at);
        });
    }
};
}  // namespace

TEST_CASE("fault injection: prepare and release on a hybrid memory (recurrent states, checkpoints) are strong") {
    auto prepare = [](const prompt_tokens& req, int slot_id) {
        return [req, slot_id](fh_world& w) {
            request_options ro;
            ro.slot_id = slot_id;
            auto p = w.slots.prepare(req, ro);
            fi::disarm();
            if (!p) return fip_describe(p);
            return "n_past " + std::to_string(p.value().n_past) + " global " + std::to_string(p.value().metrics.from_global) +
                   " checkpoint " + std::to_string(p.value().metrics.checkpoint_restored);
        };
    };
    const prompt_tokens diverging = toy::cat(toy::text(20, 1000), toy::text(10, 5000));
    fip_sweep_world<fh_world>("hybrid: exact repeat (resumed from the tail checkpoint)", false, true, prepare(fip_a, 0), {},
                              false);
    fip_sweep_world<fh_world>("hybrid: diverging at 20 (checkpoint at 16 over the slot's state)", false, true,
                              prepare(diverging, 0), {}, false);
    fip_sweep_world<fh_world>("hybrid: the global entry with its checkpoints, into slot 2", false, true,
                              prepare(diverging, 2), {}, false);
    fip_sweep_world<fh_world>(
        "hybrid: release after the host changed the slot's sequence", false, true,
        [](fh_world& w) {
            w.slots.release(2);
            return std::to_string(w.slots.tokens(2).size());
        },
        [](fh_world& w) {
            request_options ro;
            ro.slot_id = 2;
            const prompt_tokens fresh = toy::text(12, 9000);
            auto p = w.slots.prepare(fresh, ro).value();
            fh_fill(w.cache, w.slots, 2, fresh, p.n_past, p.n_request, {});
            w.slots.commit_prompt(2);
            static_cast<void>(w.cache.seq_rm(w.slots.seq_of(2), -1, -1));  // the host empties it
        },
        false);
    {  // the scenarios do what they say
        fh_world w(false);
        request_options ro;
        ro.slot_id = 0;
        auto p = w.slots.prepare(diverging, ro).value();
        CHECK(p.metrics.checkpoint_restored);
        CHECK(p.n_past == 16);
    }
}

namespace {
/// fip_world with slot_options::strong_prepare = false: the compound prepare.
template <class Cache, class Store>
struct fip_world_compound : fip_world<Cache, Store> {
    explicit fip_world_compound(bool tight) : fip_world<Cache, Store>(tight, false) {}
};
template <class Cache, class Store>
void fip_sweep_compound(bool tight) {
    using world = fip_world_compound<Cache, Store>;
    const prompt_tokens fresh = toy::text(50, 5000);
    const prompt_tokens grown = toy::cat(fip_a, toy::text(3, 7000));
    for (const auto& [name, request, slot] :
         {std::tuple{"compound prepare: a new prompt", fresh, 2},
          std::tuple{"compound prepare: growing prompt from the global cache", grown, 2}})
        fip_sweep_world<world>(name, tight, false, [req = request, slot_id = slot](world& w) {
            request_options ro;
            ro.slot_id = slot_id;
            auto p = w.slots.prepare(req, ro);
            fi::disarm();
            return p ? "n_past " + std::to_string(p.value().n_past) : fip_describe(p);
        });
}
}  // namespace

TEST_CASE("fault injection: the compound prepare (strong_prepare = false) never serves anything wrong") {
    fip_sweep_compound<contig_g, copy_store<contig_g>>(false);
    fip_sweep_compound<paged_g, copy_store<paged_g>>(true);
    fip_sweep_compound<paged_g, shared_store<paged_g>>(false);
}

TEST_CASE("fault injection: prepare with chunk reuse and its K-shift is strong") {
    using chunk_g = kv_cache<f32, reuse::global<reuse::chunk_shift<8>>>;
    // Slot 0 holds fip_a (tokens 1000..1039); the request drops tokens 8 and 9 of it: the
    // chunk policy keeps the rest of fip_a, moved by -2, and prepare rotates their K last.
    const prompt_tokens edited = toy::cat(toy::cat(toy::text(8, 1000), toy::text(30, 1010)), toy::text(2, 61000));
    auto op = [edited](fip_world<chunk_g, copy_store<chunk_g>>& w) {
        request_options ro;
        ro.slot_id = 0;
        auto p = w.slots.prepare(edited, ro);
        fi::disarm();
        if (!p) return fip_describe(p);
        return "n_past " + std::to_string(p.value().n_past) + " shifted " + std::to_string(p.value().metrics.from_shift) +
               " pending " + std::to_string(p.value().k_shift_pending);
    };
    {  // the scenario does what it says
        fip_world<chunk_g, copy_store<chunk_g>> w(false);
        request_options ro;
        ro.slot_id = 0;
        auto p = w.slots.prepare(edited, ro).value();
        REQUIRE(p.metrics.from_shift > 0);
        CHECK_FALSE(p.k_shift_pending);
        CHECK(w.cache.seq_pos_max(p.seq) == static_cast<pos_t>(p.n_past) - 1);  // the moved chunk ends at n_past
    }
    fip_sweep<chunk_g, copy_store<chunk_g>>("prepare: chunk reuse with a K-shift", false, true, op, {}, false);
}

namespace {
/// The whole structure of an index: entries, nodes, every label symbol.
std::string fip_dump(const radix_index& x) {
    std::ostringstream os;
    os << x.size() << " entries " << x.node_count() << " nodes\n";
    x.for_each_node([&](std::uint64_t salt, std::uint32_t depth, std::span<const key_symbol> label,
                        const radix_index::entry_id* e) {
        os << salt << ' ' << depth << " [";
        for (key_symbol k : label) os << ' ' << k;
        os << " ] " << (e ? std::to_string(*e) : std::string("-")) << '\n';
    });
    return os.str();
}
}  // namespace

TEST_CASE("fault injection: radix_index insert is complete or nothing, erase never allocates, the tree stays canonical") {
    std::mt19937 rng(2511);
    radix_index ix;
    std::map<std::pair<std::uint64_t, std::vector<key_symbol>>, radix_index::entry_id> model;  // the reference
    radix_index::entry_id next = 1;
    long throws = 0;
    for (int step = 0; step < 400; ++step) {
        CAPTURE(step);
        const std::uint64_t salt = rng() % 2;
        std::vector<key_symbol> key(1 + rng() % 12);
        for (auto& k : key) k = 1 + rng() % 3;  // a small alphabet: many shared prefixes, splits and merges
        if (rng() % 3 != 0 || model.empty()) {
            const std::string before = fip_dump(ix);
            bool inserted = false;
            for (long n = 1;; ++n) {
                fi::arm(n);
                try {
                    inserted = ix.insert(salt, key, next);
                    REQUIRE_FALSE(fi::disarm_fired());  // (else the points after an absorbed one go untried)
                    break;
                } catch (const std::bad_alloc&) {
                    fi::disarm();
                    ++throws;
                    REQUIRE(fip_dump(ix) == before);
                }
            }
            CHECK(inserted == !model.contains({salt, key}));
            if (inserted) model.emplace(std::pair{salt, key}, next++);
        } else {
            auto it = model.begin();
            std::advance(it, static_cast<long>(rng() % model.size()));
            const long budget = 1000000;
            fi::arm(budget);
            const bool erased = ix.erase(it->first.first, it->first.second);
            const long left = fi::countdown.load();
            fi::disarm();
            CHECK(erased);
            CHECK(left == budget);  // no allocation
            model.erase(it);
        }
        // The same tree as one built from scratch with the same keys (inserts and erases
        // leave no trace of their order).
        radix_index fresh;
        for (const auto& [k, id] : model) fresh.insert(k.first, k.second, id);
        REQUIRE(fip_dump(ix) == fip_dump(fresh));
    }
    for (const auto& [k, id] : model) {
        const auto* got = ix.find(k.first, k.second);
        REQUIRE(got != nullptr);
        CHECK(*got == id);
    }
    MESSAGE("radix_index: " << throws << " injected failures in inserts, " << model.size() << " entries left");
}

TEST_CASE("fault injection: copy_store::load of a sequence holding a position twice is complete or nothing") {
    auto build = [](contig_g& cache, copy_store<contig_g>& st) {
        toy::fill(cache, 0, toy::text(8), 0, 8);
        REQUIRE(cache.seq_div(0, 0, 8, 2));  // positions 0, 0, 1, 1, 2, 2, 3, 3: placed at stand-ins, then moved
        return st.save(cache, 0).value();
    };
    auto observe = [](const contig_g& cache) {
        std::ostringstream os;
        for (const auto& line : kvtest::snapshot(cache).lines) os << line << '\n';
        return os.str() + fip_raw(cache);
    };
    std::string before;
    {
        contig_g cache(toy::shape(64, 4));
        copy_store<contig_g> st;
        static_cast<void>(build(cache, st));
        before = observe(cache);
    }
    long throws = 0, absorbed = 0;
    for (long n = 1;; ++n) {  // a fresh cache and store per n (a failure a fallback absorbs completes the load)
        CAPTURE(n);
        contig_g cache(toy::shape(64, 4));
        copy_store<contig_g> st;
        const auto h = build(cache, st);
        bool ok = false;
        fi::arm(n);
        try {
            ok = st.load(cache, 1, h).ok();
        } catch (const std::bad_alloc&) {
            fi::disarm();
            ++throws;
            REQUIRE(fip_first_diff(before, observe(cache)) == "");  // K/V written after the last throwing step
            continue;
        }
        const bool fired = fi::disarm_fired();
        REQUIRE(ok);
        CHECK(cache.cells().seq_cell_count(1) == 8);
        CHECK(cache.seq_pos_max(1) == 3);
        if (!fired) break;
        ++absorbed;
    }
    CHECK(throws > 0);
    MESSAGE("copy_store::load (a position held twice): " << throws << " injected failures, each left the cache as it was; "
                                                         << absorbed << " absorbed by a fallback");
}
