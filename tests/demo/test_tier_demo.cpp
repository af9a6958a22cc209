// The demo's storage-tier scenario (examples/demo/tiers.hpp) end to end: kvcache_demo
// --tiers runs as a subprocess with a disk tier and a real redis-server on a loopback port
// (tests/tier/tier_redis_util.hpp starts and stops it); its JSON rows must show process B
// (a new process) served from disk and from Redis, and a restarted process from disk, each
// with logits equal to A's cold logits. The CTest test demo_tiers (examples/demo/CMakeLists.txt)
// sets KVCACHE_DEMO_EXE; without it, without hiredis or without redis-server on PATH the
// cases report a skip. Also the tier options of the command line and the children's
// `tier-result` lines.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <vector>

#include "../../examples/demo/tiers.hpp"
#include "tier/tier_redis_util.hpp"

namespace {

demo::cli::options tierdemo_parse(std::initializer_list<const char*> args) {
    std::vector<const char*> argv{"kvcache_demo"};
    argv.insert(argv.end(), args.begin(), args.end());
    return demo::cli::parse(static_cast<int>(argv.size()), argv.data());
}

/// The JSON row (one line of kvcache_demo --json) whose "request" is `request`; "" if none.
std::string tierdemo_row(const std::string& json_path, const std::string& request) {
    std::ifstream in(json_path);
    std::string line;
    const std::string needle = "\"request\": \"" + request + "\"";
    while (std::getline(in, line))
        if (line.find(needle) != std::string::npos) return line;
    return "";
}

/// The raw value of member `key` in a one-line JSON object ("" if absent): up to the next
/// ',' or '}' outside a string.
std::string tierdemo_field(const std::string& row, const std::string& key) {
    const std::string k = "\"" + key + "\": ";
    const std::size_t at = row.find(k);
    if (at == std::string::npos) return "";
    std::size_t e = at + k.size();
    bool in_string = false;
    for (; e < row.size(); ++e) {
        if (row[e] == '"' && row[e - 1] != '\\') in_string = !in_string;
        if (!in_string && (row[e] == ',' || row[e] == '}')) break;
    }
    return row.substr(at + k.size(), e - at - k.size());
}

/// Runs kvcache_demo with `args`; its exit code (-1: did not exit normally).
int tierdemo_run(const std::string& exe, const std::string& args, const std::string& log) {
    const int rc = std::system((exe + " " + args + " > " + log + " 2>&1").c_str());
    return rc != -1 && WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

/// Checks the row of a hit that must come from `tier`: positions loaded, logits as A's cold ones.
void tierdemo_check_hit(const std::string& json, const std::string& request, const std::string& tier) {
    INFO("row: ", request);
    const std::string row = tierdemo_row(json, request);
    REQUIRE(!row.empty());
    CHECK(tierdemo_field(row, "tier") == "\"" + tier + "\"");
    CHECK(std::stoul(tierdemo_field(row, "from_tier")) > 0);
    CHECK(tierdemo_field(row, "logits_check_ok") == "true");
    CHECK(tierdemo_field(row, "logits_argmax_match") == "true");
    CHECK(std::stod(tierdemo_field(row, "logits_max_abs_diff")) <= demo::scenarios::logits_tol);
    CHECK(tierdemo_field(row, "skipped") == "false");
    CHECK(tierdemo_field(row, "pass") == "true");
}

}  // namespace

TEST_CASE("demo tiers: the command line's tier options") {
    const auto d = tierdemo_parse({});
    CHECK_FALSE(d.tiers);
    CHECK(d.tier_memory_mib == -1);
    const auto o = tierdemo_parse({"--tiers"});
    CHECK(o.tiers);
    CHECK_FALSE(o.ttft);  // --tiers selects the tier run only
    const auto r = tierdemo_parse({"--redis", "10.0.0.7:6380", "--tier-dir", "/tmp/x", "--tier-memory-mib", "0"});
    CHECK(r.tiers);  // a tier option turns the tier run on
    CHECK(r.ttft);   // ... next to the others
    CHECK(r.redis_host == "10.0.0.7");
    CHECK(r.redis_port == 6380);
    CHECK(r.tier_dir == "/tmp/x");
    CHECK(r.tier_memory_mib == 0);
    CHECK_THROWS_WITH_AS(tierdemo_parse({"--redis", "localhost"}), doctest::Contains("--redis = localhost: must be HOST:PORT"),
                         demo::cli::cli_error);
    CHECK_THROWS_WITH_AS(tierdemo_parse({"--redis", "h:0"}), doctest::Contains("port must be an integer in [1, 65535]"),
                         demo::cli::cli_error);
    CHECK_THROWS_WITH_AS(tierdemo_parse({"--redis", "h:12x"}), doctest::Contains("port must be"), demo::cli::cli_error);
    CHECK_THROWS_WITH_AS(tierdemo_parse({"--tier-memory-mib", "-1"}), doctest::Contains("--tier-memory-mib = -1"),
                         demo::cli::cli_error);
    CHECK_THROWS_WITH_AS(tierdemo_parse({"--tier-role", "writer"}), doctest::Contains("must be reader or restart"),
                         demo::cli::cli_error);
    CHECK_THROWS_WITH_AS(tierdemo_parse({"--tier-role", "reader"}), doctest::Contains("needs --tier-ns"),
                         demo::cli::cli_error);
}

TEST_CASE("demo tiers: a child's tier-result line round-trips; other lines are not results") {
    demo::tiers::hit h;
    h.tier = "redis";
    h.ttft_ms = 12.5;
    h.from_tier = 999;
    h.logits.max_abs_diff = 1.5e-6;
    h.logits.argmax_same = true;
    demo::tiers::hit back;
    REQUIRE(demo::tiers::parse_hit(demo::tiers::format_hit(h), back));
    CHECK(back.tier == "redis");
    CHECK(back.ttft_ms == doctest::Approx(12.5));
    CHECK(back.from_tier == 999);
    CHECK(back.logits.max_abs_diff == doctest::Approx(1.5e-6));
    CHECK(back.logits.ok(demo::scenarios::logits_tol));
    h.logits.finite = false;
    REQUIRE(demo::tiers::parse_hit(demo::tiers::format_hit(h), back));
    CHECK_FALSE(back.logits.ok(demo::scenarios::logits_tol));  // a non-finite child result never passes
    CHECK_FALSE(demo::tiers::parse_hit("kvcache_demo: building the random Llama model", back));
    CHECK_FALSE(demo::tiers::parse_hit("tier-result disk 1.0 12", back));  // cut short
}

TEST_SUITE("demo_tiers") {
TEST_CASE("demo tiers: process B hits disk and Redis, a restarted process hits disk") {
    const char* exe = std::getenv("KVCACHE_DEMO_EXE");
    if (exe == nullptr || *exe == '\0') {
        MESSAGE("skipped: KVCACHE_DEMO_EXE is not set (the CTest test demo_tiers sets it)");
        return;
    }
#if !KVCACHE_HAS_REDIS_TIER
    MESSAGE("skipped: built without hiredis");
#else
    if (!tiertest::redis_on_path("redis-server")) {
        MESSAGE("skipped: redis-server is not on PATH");
        return;
    }
    namespace fs = std::filesystem;
    const fs::path scratch = fs::temp_directory_path() / ("kvcache_tierdemo_test-" + std::to_string(::getpid()));
    fs::remove_all(scratch);
    fs::create_directories(scratch);
    const std::string json = (scratch / "rows.json").string(), log = (scratch / "demo.log").string();
    const std::string tier_dir = (scratch / "tiers").string();
    const std::string common = " --tiers --no-timing --threads 1 --base-tokens 128 --tier-dir " + tier_dir + " --json " + json;

    SUBCASE("with Redis") {
        tiertest::redis_server srv;
        REQUIRE(tiertest::redis_start_any(srv, scratch.string(), false, 11));
        const int rc = tierdemo_run(exe, common + " --redis 127.0.0.1:" + std::to_string(srv.port), log);
        INFO("kvcache_demo log: ", log);
        CHECK(rc == 0);
        const std::string cold = tierdemo_row(json, "cold (tiers attached, all miss)");
        REQUIRE(!cold.empty());
        CHECK(tierdemo_field(cold, "from_tier") == "0");
        CHECK(tierdemo_field(cold, "tier") == "null");
        tierdemo_check_hit(json, "memory tier (fresh cache) (median of 3)", "memory");
        tierdemo_check_hit(json, "disk tier (fresh cache, empty memory tier) (median of 3)", "disk");
        tierdemo_check_hit(json, "Redis tier (fresh cache, Redis only) (median of 3)", "redis");
        tierdemo_check_hit(json, "process B (new): disk tier", "disk");
        tierdemo_check_hit(json, "process B (new): Redis tier", "redis");
        tierdemo_check_hit(json, "restarted process: disk tier", "disk");
        // The run's entries live in a folder of its own, removed at the end.
        CHECK(fs::is_empty(tier_dir));
    }
    SUBCASE("without Redis: its rows are skipped, disk still shared") {
        const int rc = tierdemo_run(exe, common, log);
        INFO("kvcache_demo log: ", log);
        CHECK(rc == 0);
        tierdemo_check_hit(json, "process B (new): disk tier", "disk");
        tierdemo_check_hit(json, "restarted process: disk tier", "disk");
        for (const char* request : {"Redis tier: skipped (no --redis)", "process B (new): Redis tier: skipped (no --redis)"}) {
            INFO("row: ", request);
            const std::string row = tierdemo_row(json, request);
            REQUIRE(!row.empty());
            CHECK(tierdemo_field(row, "skipped") == "true");
        }
    }
    fs::remove_all(scratch);
#endif
}
}  // TEST_SUITE
