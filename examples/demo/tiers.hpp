// kvcache_demo: the storage-tier scenario (--tiers; issue 30). The global prompt cache of
// one process gets tiers below it (kvcache/tier: memory -> disk -> Redis, those given), and
// the TTFT of the demo's base prompt (the TTFT scenarios' 1,000-token prompt) is measured
// when its prefix is served
//   (a) cold (tiers attached, every probe a miss; the release publishes to every tier),
//   (b) from the memory tier (a fresh cache and server, the same tier chain),
//   (c) from the disk tier (a fresh cache and server, an empty memory tier, the same directory),
//   (d) from Redis (a fresh cache and server with only the Redis tier),
// each as a fraction of (a), its logits compared with (a)'s like the TTFT scenarios do. Then
// the multi-process part: a NEW process B (fork + exec of this program, --tier-role reader)
// serves the prompt from disk and from Redis, and a "restarted" process (--tier-role restart,
// disk only) hits the disk tier; each child prints one `tier-result` line per hit (its TTFT,
// the positions it loaded from a tier, its logits against A's cold logits, which A hands it
// in a file), and A puts them in its table.
//
// The tiers of one run live under a run namespace (A's process id and start time): the disk
// tier in <--tier-dir>/demo-<ns> (removed at the end), Redis keys under "kvcache-demo:<ns>:"
// (expiring after 10 minutes), so a run is never served by an earlier one and the cold row is
// cold. The demo never starts a redis-server: without --redis the Redis rows say "skipped".
#pragma once

#include <fcntl.h>     // open
#include <sys/wait.h>  // waitpid
#include <unistd.h>    // fork, execv, pipe, getpid

#include <algorithm>   // std::sort
#include <chrono>      // the run namespace
#include <cstddef>     // std::byte, std::size_t
#include <cstdint>     // fixed-width integers
#include <cstdio>      // progress lines, tier-result lines
#include <cstring>     // std::strncmp
#include <filesystem>  // run directory, logits file
#include <fstream>     // logits file
#include <optional>    // maybe_tier
#include <span>        // blobs
#include <string>      // names, paths
#include <string_view> // tier names
#include <utility>     // std::move
#include <vector>      // rows, argv

#include <kvcache/kvcache.hpp>
#include <kvcache/tier/disk_tier.hpp>
#include <kvcache/tier/redis_tier.hpp>
#include <kvcache/tier/tier_cache.hpp>

#include "cli.hpp"
#include "engine/compare.hpp"
#include "engine/engine.hpp"
#include "engine/sampler.hpp"
#include "engine/server.hpp"
#include "report.hpp"
#include "scenarios.hpp"

namespace demo::tiers {

using cli::options;
using report::row;

/// A tier of the demo's fixed chain that may be absent (its option not given): absent, it
/// holds nothing and refuses every put. So one tier_cache type serves every combination of
/// --tier-memory-mib, --tier-dir and --redis, and a tier's index in the chain names it.
template <class T>
class maybe_tier {
public:
    maybe_tier() = default;
    explicit maybe_tier(T t) : t_(std::move(t)) {}

    kvcache::result<void> put(const kvcache::tier::key& k, std::span<const std::byte> blob) {
        if (!t_) return kvcache::detail::make_error(kvcache::errc::no_space, "maybe_tier: tier not configured");
        return t_->put(k, blob);
    }
    /// T's put taking the bytes, and its map() where T has one (tier/tier.hpp, members 7, 8).
    kvcache::result<void> put(const kvcache::tier::key& k, std::vector<std::byte>&& blob) {
        if (!t_) return kvcache::detail::make_error(kvcache::errc::no_space, "maybe_tier: tier not configured");
        return t_->put(k, std::move(blob));
    }
    bool get(const kvcache::tier::key& k, std::vector<std::byte>& out) { return t_ && t_->get(k, out); }
    bool map(const kvcache::tier::key& k, kvcache::tier::mapped_blob& out)
        requires kvcache::tier::mappable_tier<T>
    {
        return t_ && t_->map(k, out);
    }
    [[nodiscard]] bool contains(const kvcache::tier::key& k) { return t_ && t_->contains(k); }
    bool erase(const kvcache::tier::key& k) { return t_ && t_->erase(k); }
    [[nodiscard]] std::size_t bytes() const { return t_ ? t_->bytes() : 0; }
    [[nodiscard]] std::string_view name() const { return t_ ? t_->name() : std::string_view("none"); }
    [[nodiscard]] bool present() const noexcept { return t_.has_value(); }
    [[nodiscard]] T* get_if() noexcept { return t_ ? &*t_ : nullptr; }

private:
    std::optional<T> t_;
};

#if KVCACHE_HAS_REDIS_TIER
using redis_type = kvcache::tier::redis_tier;
inline constexpr bool have_redis = true;
#else
/// Stand-in when the demo is built without hiredis: --redis is refused at run time.
struct redis_type {
    kvcache::result<void> put(const kvcache::tier::key&, std::span<const std::byte>) {
        return kvcache::detail::make_error(kvcache::errc::io_error, "built without hiredis");
    }
    bool get(const kvcache::tier::key&, std::vector<std::byte>&) { return false; }
    bool contains(const kvcache::tier::key&) { return false; }
    bool erase(const kvcache::tier::key&) { return false; }
    [[nodiscard]] std::size_t bytes() const { return 0; }
    [[nodiscard]] std::string_view name() const { return "redis"; }
    void sync() {}
};
inline constexpr bool have_redis = false;
#endif

/// The demo's chain: memory (index 0) -> disk (1) -> Redis (2), absent ones skipped.
template <class Cache>
using chain = kvcache::tier::tier_cache<Cache, maybe_tier<kvcache::tier::memory_tier>,
                                        maybe_tier<kvcache::tier::disk_tier>, maybe_tier<redis_type>>;

/// Name of the tier at index i of the chain ("-" for -1, a miss).
[[nodiscard]] inline const char* tier_name(int i) noexcept {
    return i == 0 ? "memory" : i == 1 ? "disk" : i == 2 ? "redis" : "-";
}

/// Which tiers a chain holds.
struct tier_set {
    bool memory = false;
    bool disk = false;
    bool redis = false;
};

/// The disk tier's folder of run `ns`: <--tier-dir>/demo-<ns>.
[[nodiscard]] inline std::string run_dir(const options& o, const std::string& ns) { return o.tier_dir + "/demo-" + ns; }

/// The chain of run `ns` holding the tiers of `which` (each must be configured in o).
/// Throws kvcache::error when the disk folder cannot be created, std::runtime_error for
/// --redis in a build without hiredis.
template <class Cache>
chain<Cache> make_chain(const options& o, const std::string& ns, tier_set which) {
    maybe_tier<kvcache::tier::memory_tier> m;
    maybe_tier<kvcache::tier::disk_tier> d;
    maybe_tier<redis_type> r;
    if (which.memory) {
        const std::size_t mib = o.tier_memory_mib < 0 ? 512 : static_cast<std::size_t>(o.tier_memory_mib);
        m = maybe_tier<kvcache::tier::memory_tier>(kvcache::tier::memory_tier(mib << 20));
    }
    if (which.disk) d = maybe_tier<kvcache::tier::disk_tier>(kvcache::tier::disk_tier(run_dir(o, ns)));
    if (which.redis) {
#if KVCACHE_HAS_REDIS_TIER
        kvcache::tier::redis_tier_options ro;
        ro.nodes = {kvcache::tier::redis_endpoint{o.redis_host, o.redis_port}};
        ro.prefix = "kvcache-demo:" + ns + ":";
        ro.ttl_ms = 10 * 60 * 1000;
        r = maybe_tier<redis_type>(kvcache::tier::redis_tier(ro));
#else
        throw std::runtime_error("--redis: this kvcache_demo was built without hiredis (libhiredis-dev)");
#endif
    }
    return chain<Cache>(kvcache::tier::tier_cache_options{}, std::move(m), std::move(d), std::move(r));
}

/// Sends the Redis tier's queued writes (its SETs are pipelined): before another process reads.
template <class Cache>
void flush_redis(chain<Cache>& ch) {
    if (auto* r = ch.template get<2>().get_if()) r->sync();
}

/// One hit as a child process reports it (a `tier-result` line) or A measures it.
struct hit {
    std::string tier;         ///< tier that served the prefix ("-": a miss)
    double ttft_ms = 0;
    std::uint32_t from_tier = 0;  ///< positions loaded from the tier
    demo::logits_comparison logits;
};

/// The `tier-result` line of a child: "tier-result <tier> <ttft_ms> <from_tier> <max_abs_diff> <argmax> <finite>".
[[nodiscard]] inline std::string format_hit(const hit& h) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "tier-result %s %.6f %u %.9g %d %d", h.tier.c_str(), h.ttft_ms, h.from_tier,
                  h.logits.max_abs_diff, h.logits.argmax_same ? 1 : 0, h.logits.finite ? 1 : 0);
    return buf;
}
/// Parses a `tier-result` line; false when `line` is not one.
[[nodiscard]] inline bool parse_hit(const std::string& line, hit& h) {
    char tier[16] = {};
    double ms = 0, diff = 0;
    unsigned from = 0;
    int argmax = 0, finite = 0;
    if (std::sscanf(line.c_str(), "tier-result %15s %lf %u %lf %d %d", tier, &ms, &from, &diff, &argmax, &finite) != 6)
        return false;
    h.tier = tier;
    h.ttft_ms = ms;
    h.from_tier = from;
    h.logits.max_abs_diff = diff;
    h.logits.argmax_same = argmax != 0;
    h.logits.finite = finite != 0;
    return true;
}

/// Runs this program again (/proc/self/exe) with `args`; its stdout lines are echoed with
/// `label` in front, its `tier-result` lines returned. exit_ok: it exited with code 0.
inline std::vector<hit> run_child(const std::vector<std::string>& args, const std::string& label, bool& exit_ok) {
    exit_ok = false;
    std::vector<hit> hits;
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("tiers: pipe() failed");
    std::vector<const char*> argv;
    argv.push_back("kvcache_demo");
    for (const std::string& a : args) argv.push_back(a.c_str());
    argv.push_back(nullptr);
    std::fflush(stdout);
    const pid_t pid = ::fork();
    if (pid < 0) {
        ::close(fds[0]);
        ::close(fds[1]);
        throw std::runtime_error("tiers: fork() failed");
    }
    if (pid == 0) {
        ::close(fds[0]);
        if (::dup2(fds[1], 1) < 0) ::_exit(126);
        ::close(fds[1]);
        ::execv("/proc/self/exe", const_cast<char* const*>(argv.data()));
        ::_exit(127);
    }
    ::close(fds[1]);
    FILE* in = ::fdopen(fds[0], "r");
    if (in == nullptr) {
        ::close(fds[0]);
        ::waitpid(pid, nullptr, 0);
        throw std::runtime_error("tiers: fdopen() failed");
    }
    char buf[1024];
    std::string line;
    while (std::fgets(buf, sizeof buf, in) != nullptr) {
        line += buf;
        if (line.empty() || line.back() != '\n') continue;
        line.pop_back();
        hit h;
        if (parse_hit(line, h)) hits.push_back(h);
        std::printf("  [%s] %s\n", label.c_str(), line.c_str());
        line.clear();
    }
    std::fclose(in);
    int st = 0;
    if (::waitpid(pid, &st, 0) == pid) exit_ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
    return hits;
}

/// The base prompt of the TTFT scenarios (scenarios::basic_ttft_runner::run): BOS and
/// base_tokens - 1 tokens of text seed seed + 1.
inline std::vector<token_t> base_prompt(const demo::tokenizer& tok, const options& o) {
    scenarios::text_source text(tok, o.seed + 1);
    std::vector<token_t> base{demo::tokenizer::bos};
    const auto body = text.tokens(static_cast<std::size_t>(o.base_tokens) - 1);
    base.insert(base.end(), body.begin(), body.end());
    return base;
}

/// Writes / reads the cold logits A hands to its children (raw floats).
inline void write_logits(const std::string& path, const std::vector<float>& l) {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(l.data()), static_cast<std::streamsize>(l.size() * sizeof(float)));
    if (!out) throw std::runtime_error("tiers: cannot write " + path);
}
inline std::vector<float> read_logits(const std::string& path) {
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    if (!in) throw std::runtime_error("tiers: cannot read " + path);
    const auto n = static_cast<std::size_t>(in.tellg()) / sizeof(float);
    std::vector<float> l(n);
    in.seekg(0);
    in.read(reinterpret_cast<char*>(l.data()), static_cast<std::streamsize>(n * sizeof(float)));
    if (!in) throw std::runtime_error("tiers: cannot read " + path);
    return l;
}

/// The tier scenario with K/V element E (--cache-type): run() in process A, child() in the
/// processes it starts (--tier-role).
template <class E = kvcache::f32>
class tier_runner {
    using cache_type = scenarios::server_cache_of<E>;
    using chain_type = chain<cache_type>;

public:
    /// args: A's command line without the program name (its children get it again).
    tier_runner(const demo::llama_weights& w, const demo::tokenizer& tok, const options& o,
                std::vector<std::string> args = {})
        : opt_(o), engine_(w), base_(base_prompt(tok, o)), args_(std::move(args)) {}

    /// Process A: rows (a)-(d), then B's and the restarted process's rows.
    std::vector<row> run() {
        const options& o = opt_;
        ns_ = std::to_string(::getpid()) + "-" +
              std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                 std::chrono::system_clock::now().time_since_epoch()).count());
        const tier_set all{o.tier_memory_mib != 0, !o.tier_dir.empty(), !o.redis.empty()};
        std::printf("tiers: memory %s, disk %s, Redis %s; run namespace %s\n",
                    all.memory ? (std::to_string(o.tier_memory_mib < 0 ? 512 : o.tier_memory_mib) + " MiB").c_str() : "none",
                    all.disk ? run_dir(o, ns_).c_str() : "none (no --tier-dir)",
                    all.redis ? o.redis.c_str() : "none (no --redis)", ns_.c_str());
        chain_type main_chain = make_chain<cache_type>(o, ns_, all);

        // (a) cold: every tier misses; the release publishes the prompt to each.
        {
            setup s(engine_, n_cells(), main_chain);
            const demo::response r = serve(s);
            cold_ms_ = r.ttft_ms;
            cold_logits_ = r.logits;
            row x = make_row(1, "cold (tiers attached, all miss)", r, std::nullopt);
            x.check_ok = r.metrics.tier < 0 && r.metrics.from_tier == 0;
            x.check = x.check_ok ? "all miss" : "NOT COLD";
            x.pass = x.check_ok;
            print_row(x, r.prepare_ms);
            rows_.push_back(x);
        }
        flush_redis(main_chain);

        // (b) memory, (c) disk, (d) Redis: median of 3 fresh caches each.
        if (all.memory)
            median_of_3(2, "memory tier (fresh cache)", 0, 0.02, [&](auto&& f) { return f(main_chain); });
        else
            skipped(2, "memory tier: skipped (--tier-memory-mib 0)", 0.02);
        if (all.disk)
            median_of_3(3, "disk tier (fresh cache, empty memory tier)", 1, 0.05, [&](auto&& f) {
                chain_type c = make_chain<cache_type>(o, ns_, tier_set{all.memory, true, false});
                return f(c);
            });
        else
            skipped(3, "disk tier: skipped (no --tier-dir)", 0.05);
        if (all.redis)
            median_of_3(4, "Redis tier (fresh cache, Redis only)", 2, 0.10, [&](auto&& f) {
                chain_type c = make_chain<cache_type>(o, ns_, tier_set{false, false, true});
                return f(c);
            });
        else
            skipped(4, "Redis tier: skipped (no --redis)", 0.10);

        multi_process(all);
        if (all.disk) {
            std::error_code ec;
            std::filesystem::remove_all(run_dir(o, ns_), ec);
        }
        return rows_;
    }

    /// A child process (--tier-role reader: disk then Redis; restart: disk only): one
    /// `tier-result` line per tier on stdout. Returns the exit code (0: every hit came from
    /// its tier with logits equal to A's cold logits).
    int child() {
        const options& o = opt_;
        ns_ = o.tier_ns;
        cold_logits_ = read_logits(o.tier_logits);
        cold_ms_ = o.tier_cold_ms;
        bool ok = true;
        auto one = [&](tier_set which, int want) {
            chain_type c = make_chain<cache_type>(o, ns_, which);
            setup s(engine_, n_cells(), c);
            const demo::response r = serve(s);
            hit h;
            h.tier = tier_name(r.metrics.tier);
            h.ttft_ms = r.ttft_ms;
            h.from_tier = r.metrics.from_tier;
            h.logits = compare(r.logits);
            std::printf("%s\n", format_hit(h).c_str());
            ok = ok && r.metrics.tier == want && h.from_tier > 0 && h.logits.ok(scenarios::logits_tol);
        };
        if (!o.tier_dir.empty()) one(tier_set{o.tier_memory_mib != 0, true, false}, 1);
        if (o.tier_role == "reader" && !o.redis.empty()) one(tier_set{false, false, true}, 2);
        return ok ? 0 : 1;
    }

private:
    /// The cells of one request: the slot's sequence and the hook's scratch copy.
    std::uint32_t n_cells() const { return static_cast<std::uint32_t>(opt_.base_tokens) * 2 + 256; }

    /// A fresh cache and server (one slot, sequence 0; the tiers' scratch sequence 1) with
    /// chain ch attached.
    struct setup {
        cache_type cache;
        demo::server<cache_type> srv;
        setup(demo::llama_engine<cache_type>& e, std::uint32_t cells, chain_type& ch)
            : cache(e.cache_shape(cells, 2)), srv(e, cache, kvcache::slot_options{}) {
            kvcache::tier_hook_options h;
            h.scratch_seq = 1;  // one past the slots'
            srv.slots().attach_tiers(ch, h);
        }
        ~setup() { srv.slots().detach_tiers(); }
        setup(const setup&) = delete;
        setup& operator=(const setup&) = delete;
    };

    demo::response serve(setup& s) {
        demo::sampler greedy(0.0f, 0);
        return s.srv.serve(base_, kvcache::request_options{}, 1, greedy);
    }

    demo::logits_comparison compare(const std::vector<float>& got) const {
        if (got.size() != cold_logits_.size())
            throw demo::model_error("tiers: " + std::to_string(got.size()) + " logits, the cold run had " +
                                    std::to_string(cold_logits_.size()));
        return demo::compare_logits(got.data(), cold_logits_.data(), got.size());
    }

    /// The fields every tier row shares: round, request, the tier that served it, TTFT.
    row base_row(int round, const std::string& what, const std::string& tier, double ttft_ms,
                 std::optional<double> expected) const {
        row x;
        x.scenario = "tiers";
        x.cache_type = std::string(E::name);
        x.round = round;
        x.what = what;
        x.n_prompt = base_.size();
        x.tier = tier;
        x.ttft_ms = ttft_ms;
        x.ratio = ttft_ms / cold_ms_;
        x.expected_max = expected;
        return x;
    }

    row make_row(int round, const std::string& what, const demo::response& r, std::optional<double> expected) const {
        row x = base_row(round, what, r.metrics.tier >= 0 ? tier_name(r.metrics.tier) : "", r.ttft_ms, expected);
        x.m = r.metrics;
        return x;
    }

    /// The row of a hit that must come from tier `want` (also a child's).
    row hit_row(int round, const std::string& what, const hit& h, int want, double expected) const {
        row x = base_row(round, what, h.tier == "-" ? "" : h.tier, h.ttft_ms, expected);
        x.m.from_tier = h.from_tier;
        x.m.n_request = static_cast<std::uint32_t>(base_.size());
        x.m.computed = static_cast<std::uint32_t>(base_.size()) - h.from_tier;
        x.max_abs_diff = h.logits.max_abs_diff;
        x.argmax_match = h.logits.argmax_same;
        const bool from_ok = h.tier == tier_name(want) && h.from_tier > 0;
        x.check_ok = from_ok && h.logits.ok(scenarios::logits_tol);
        x.check = (from_ok ? std::string() : std::string("NOT FROM ") + tier_name(want) + "; ") + scenarios::logits_label(h.logits);
        judge(x, opt_.timing, opt_.strict_timing);
        return x;
    }

    void print_row(const row& x, double prepare_ms) const {
        std::printf("  %-6s r%d %-48s %5zu tok  from %-6s %5u  TTFT %8.1f ms (prepare %6.1f)  ratio %6.1f%%  %s\n",
                    x.scenario.c_str(), x.round, x.what.c_str(), x.n_prompt, x.tier.empty() ? "-" : x.tier.c_str(),
                    x.m.from_tier, x.ttft_ms, prepare_ms, 100.0 * x.ratio, x.pass && !x.off_target ? "" : result_label(x));
        std::fflush(stdout);
    }

    /// Three requests, each on a fresh cache and server with the chain `with` gives; the
    /// median row is kept (a failed check instead).
    template <class With>
    void median_of_3(int round, const std::string& what, int want, double expected, With with) {
        std::vector<row> reps;
        for (int i = 0; i < 3; ++i) {
            with([&](chain_type& c) {
                setup s(engine_, n_cells(), c);
                const demo::response r = serve(s);
                hit h{r.metrics.tier >= 0 ? tier_name(r.metrics.tier) : "-", r.ttft_ms, r.metrics.from_tier, compare(r.logits)};
                row x = hit_row(round, what, h, want, expected);
                x.m = r.metrics;
                print_row(x, r.prepare_ms);
                reps.push_back(x);
                return 0;
            });
        }
        std::sort(reps.begin(), reps.end(), [](const row& a, const row& b) { return a.ttft_ms < b.ttft_ms; });
        const auto bad = std::find_if(reps.begin(), reps.end(), [](const row& x) { return !x.check_ok; });
        row x = bad != reps.end() ? *bad : reps[1];
        x.what += " (median of 3)";
        rows_.push_back(x);
    }

    void skipped(int round, const std::string& what, std::optional<double> expected) {
        row x;
        x.scenario = "tiers";
        x.cache_type = std::string(E::name);
        x.round = round;
        x.what = what;
        x.n_prompt = base_.size();
        x.expected_max = expected;
        x.skipped = true;
        x.check = "skipped";
        x.ttft_ms = 0;
        x.ratio = 0;
        rows_.push_back(x);
    }

    /// The children's command line: A's, without --json, with the role and the run's data.
    std::vector<std::string> child_args(const std::string& role, const std::string& logits) const {
        std::vector<std::string> a;
        for (std::size_t i = 0; i < args_.size(); ++i) {
            if (args_[i] == "--json") {
                ++i;
                continue;
            }
            a.push_back(args_[i]);
        }
        char cold[32];
        std::snprintf(cold, sizeof cold, "%.6f", cold_ms_);
        for (const std::string& s : {std::string("--tier-role"), role, std::string("--tier-ns"), ns_,
                                     std::string("--tier-cold-ms"), std::string(cold), std::string("--tier-logits"), logits})
            a.push_back(s);
        return a;
    }

    /// Process B (reader: disk, Redis) and the restarted process (disk), each a new process.
    void multi_process(const tier_set& all) {
        if (!all.disk && !all.redis) {
            skipped(5, "process B: skipped (no --tier-dir, no --redis)", std::nullopt);
            return;
        }
        const std::string logits = all.disk ? run_dir(opt_, ns_) + "/cold_logits.f32"
                                            : (std::filesystem::temp_directory_path() / ("kvcache_demo-" + ns_ + ".f32")).string();
        write_logits(logits, cold_logits_);
        std::printf("scenario: a new process B (exec of this program) serves the prompt from the shared tiers\n");
        bool b_ok = false;
        const std::vector<hit> b = run_child(child_args("reader", logits), "B", b_ok);
        std::size_t next = 0;
        auto take = [&](int round, const std::string& what, int want, double expected, bool exited_ok,
                        const std::vector<hit>& hits) {
            if (next < hits.size()) {
                row x = hit_row(round, what, hits[next++], want, expected);
                x.pass = x.pass && exited_ok;
                rows_.push_back(x);
            } else {
                row x;
                x.scenario = "tiers";
                x.round = round;
                x.what = what;
                x.n_prompt = base_.size();
                x.expected_max = expected;
                x.check = "NO RESULT FROM THE CHILD";
                x.check_ok = x.pass = false;
                rows_.push_back(x);
            }
        };
        if (all.disk) take(5, "process B (new): disk tier", 1, 0.05, b_ok, b);
        else skipped(5, "process B (new): disk tier: skipped (no --tier-dir)", 0.05);
        if (all.redis) take(6, "process B (new): Redis tier", 2, 0.10, b_ok, b);
        else skipped(6, "process B (new): Redis tier: skipped (no --redis)", 0.10);
        if (all.disk) {
            std::printf("scenario: a restarted process (exec, disk tier only) serves the prompt from the disk tier\n");
            bool r_ok = false;
            const std::vector<hit> r = run_child(child_args("restart", logits), "restart", r_ok);
            next = 0;
            take(7, "restarted process: disk tier", 1, 0.05, r_ok, r);
        } else {
            skipped(7, "restarted process: skipped (no --tier-dir)", 0.05);
        }
        std::error_code ec;
        std::filesystem::remove(logits, ec);
    }

    const options& opt_;
    demo::llama_engine<cache_type> engine_;
    std::vector<token_t> base_;
    std::vector<std::string> args_;
    std::string ns_;
    double cold_ms_ = 1;
    std::vector<float> cold_logits_;
    std::vector<row> rows_;
};

}  // namespace demo::tiers
