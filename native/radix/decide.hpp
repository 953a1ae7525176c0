// The router's decision in plain C++ (no Python): each worker's figures, the cost model's
// expected time to first token, prefix heat, and the prompt_tree and cost policies' choice.
// router.policies documents the rules; tests/router/policy_model.py is the reference model the
// tests drive beside it. The binding (bind_decide.cpp) fills `Held` from a prompt tree's walk.
#pragma once

#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>
#include <vector>

namespace route {

constexpr int kRateWindow = 32;  // the last requests a worker finished, for its service rate
constexpr int kMinRateSamples = 4;
constexpr double kDrawnHalfLifeS = 60.0;  // how long a worker's drawn traffic counts
constexpr double kFreshBand = 2.0;  // a new prefix's workers: starting it <= this x the soonest
constexpr double kFreshSpeedBand = 2.5;  // ... and at most this x slower than the fastest of them

// One worker as the router sees it: counters the request path keeps, what the worker reports,
// its learned speed over the cost model's constants (router.speed), and what it can do.
struct WorkerState {
    int64_t in_flight = 0, in_flight_tokens = 0;            // this router's requests
    int64_t peer_in_flight = 0, peer_in_flight_tokens = 0;  // other replicas' (router.replicas)
    int64_t reported_reqs = 0, reported_waiting = 0, reported_pending_tokens = 0;
    // The reports asked of it (a request in flight records the count when it is sent), and
    // of this router's requests in flight when the last one was asked for, those answered
    // since: they have left what the report counts (a sequential client's last request,
    // still counted for up to a load interval, moved its next one off its holder).
    int64_t report_asks = 0, reported_ended = 0;
    int64_t unstarted = 0;     // this router's requests not begun (first byte not seen)
    int64_t pulls_served = 0;  // requests in flight pulling a prefix from it
    bool prefill = false;      // a PD prefill: its queue is the model alone
    bool has_agent = false;    // serves MemPool pulls
    bool can_pull = false;     // pulls a longer prefix when a request names one
    int64_t free_tokens = -1;  // device KV it has free, as its KV events tell (-1: not known)
    // Seconds this router's requests not begun wait before their prefills, modelled and not
    // learned (an adapter's load): the requests queued behind them wait as long.
    double in_flight_fixed_s = 0.0;
    double overhead_s = 0.0, queue_x = 1.0, token_x = 1.0, pair_x = 1.0;
    double transfer_x = 1.0;  // x the constants' transfer time of a pull into it
    // Prompt tokens the prompt_tree rule sent it to compute, decayed with a half-life of
    // kDrawnHalfLifeS on the traffic clock (the heat's) since `drawn_at`.
    double drawn = 0.0, drawn_at = 0.0;

    int64_t load() const;
    int64_t reported_left() const;  // of its reported requests, those still there
    int64_t queued_tokens() const;
    int64_t waiting() const;
    void finish(double at);  // a request ended at `at` (time.monotonic)
    int finished() const { return finished_n_; }
    bool service_rate(double now, double& rate) const;  // false: too few to tell
    double measured_wait_s(double now) const;
    double drawn_now(double now) const;
    void draw(int64_t tokens, double now);
    double prefill_s(double tokens_s, double pairs_s) const {
        return overhead_s + token_x * tokens_s + pair_x * pairs_s;
    }

  private:
    double finished_at_[kRateWindow] = {};
    int finished_n_ = 0, finished_head_ = 0;  // ring: the oldest at head once full
    double finished(int i) const;             // i-th oldest
};

// The cost model's constants (router.policies.CostModel).
struct Costs {
    double prefill_s_per_token = 4.0e-5;
    double transfer_s_per_token = 5.2e-6;
    double busy_s_per_request = 2.0e-3;
    double host_load_s_per_token = 2.6e-6;
    double prefill_s_per_token_pair = 1.3e-9;
};

// A plan's terms at the constants: what router.speed learns each worker's coefficients of
// (moved_s: a pull's transfer), and fixed_s, modelled and not learned (host-tier loads).
struct Work {
    double queue_s = 0, tokens_s = 0, pairs_s = 0, moved_s = 0, fixed_s = 0;
};

struct Plan {
    double seconds = 0;
    int64_t computed = 0;
    bool pull = false;
    Work work;
};

// How `w` would serve a prompt of `n` tokens holding `cached` of them (`host` of those on its
// host tier, to load first); `source` (or null) holds `best` and may be pulled from, its link
// shared with the pulls already planned from it.
Plan plan(const Costs& c, const WorkerState& w, int64_t n, int64_t cached, int64_t host,
          const WorkerState* source, int64_t best, int64_t load, double now);

// Seconds before a new prefill starts on `w` (host: tokens to load from its host tier first);
// `work` gets its modelled part at the constants.
double queue_s(const Costs& c, const WorkerState& w, int64_t host, int64_t load, double now,
               double* work);

// How hot a prefix is: how many recent requests reused it, decayed over time (keyed by its
// length and last page). A prefix one conversation reuses (its history) is not worth copying
// to another worker: the copy displaces other cache there and serves nobody else. A prefix
// many requests share (a system or tool prompt) is: each copy spreads its traffic over one
// more worker. The prompt_tree rule divides the price of moving a prefix by its heat while
// the prefix has fewer copies than its share of all requests needs workers: once it has as
// many, another copy only displaces other prefixes' cache (the 10-prefix sweep cell, 4
// workers: hit 86% against cache_aware's 92% with every hot move discounted; 88-89% with
// this bound).
class Heat {
  public:
    Heat(uint32_t page_size, double half_life_s, size_t max_entries, double now);
    double bump(const uint32_t* tokens, size_t n, int64_t length, double now);
    double share(double heat) const { return before_ > 0 ? heat / before_ : 0.0; }
    double before() const { return before_; }
    size_t size() const { return counts_.size(); }
    uint32_t page_size() const { return ps_; }

  private:
    struct Entry {
        double count, at;
        std::list<std::string>::iterator order;
    };
    uint32_t ps_;
    double rate_;
    size_t max_entries_;
    double before_ = 0.0, total_ = 0.0, total_at_;
    std::unordered_map<std::string, Entry> counts_;
    std::list<std::string> order_;  // least recently seen first
};

struct Thresholds {
    int64_t balance_abs = 64;
    double balance_rel = 1.5;
    bool imbalanced(int64_t high, int64_t low) const {
        return high - low > balance_abs && high > low * balance_rel;
    }
};

// What the trees hold of the prompt for one candidate (tokens; -1: no entry).
struct Held {
    int64_t any = -1, device = -1, home = -1;
};

enum class Reason : uint8_t {
    CacheHit, CacheMiss, HostHit, Home, HomeBusy, Overload, Pull, OverloadPull, HomeBusyPull,
    HomePull
};
const char* reason_name(Reason r);

struct Choice {
    size_t worker = 0;
    Reason reason = Reason::CacheMiss;
    int64_t predicted_cached = 0;
    std::vector<std::pair<size_t, int64_t>> holders;  // longer prefixes, longest first
    int64_t pull_from = -1;
    int64_t computed = 0;  // prompt tokens the choice computes (the rest it holds or pulls)
    Work work;
};

enum class Rule : uint8_t { PromptTree, Cost };

struct Settings {
    Rule rule = Rule::PromptTree;
    uint32_t page_size = 16;
    bool pulls = true;
    Costs costs;
    Thresholds thresholds;
};

// A new prefix (held nowhere, and no home) goes, of the workers expected to start it at most
// kFreshBand times as late as the soonest (placement) and at most kFreshSpeedBand times
// slower than the fastest of those (token_x), to where the fewest requests wait,
// then where the least work was drawn lately (its drawn tokens at its speed), as cache_aware
// sends a miss to its smallest tree, then where the fewest requests are (an empty prompt,
// or workers that drew nothing yet). Sent to the soonest start alone, every new prefix at an
// idle moment went to the worker the speed fit put a few percent ahead; its cache churned
// while the others' aged. The bands keep a worker several times slower out (the fit's spread
// over identical workers reached 2x in the 10-prefix sweep cell: 0.81-1.69): with the start
// band alone, a fast worker with a request queued lost new prefixes to an idle one 4x slower
// (fewer waiting there), and every later request for them was served at a quarter speed
// (the mixed sweep cell's p99: 0.79x cache_aware's, 0.67x with the speed band). The prompt_tree
// rule records each choice's computed tokens on its worker (WorkerState::draw) at `heat_now`.
//
// The choice among `workers` (never empty) for a prompt of `num_tokens` tokens whose first
// `n` ids are `tokens` (what the trees matched), `held` per worker; `heat` is bumped by the
// prompt_tree rule. `now`: time.monotonic, for measured waits; `heat_now`: the heat's clock.
// `before` (or null): seconds each worker would spend on this request before its prefill
// that the cost model does not price (a LoRA adapter to load: router.adapters).
// `pull_limit`: the most of the prefix a pull may cover (-1: all of it; 0: none, and no
// holders named: router.policies.pull_limit says for which namespaced requests).
// `stall` (or null): of `before`, the seconds the engine spends on the request's behalf in
// the step that prefills it (an adapter's load), which every request waiting there waits too;
// not a wait for an adapter slot (the engine runs the others meanwhile).
Choice decide(const Settings& s, const std::vector<const WorkerState*>& workers,
              const std::vector<Held>& held, const uint32_t* tokens, size_t n,
              int64_t num_tokens, Heat* heat, double now, double heat_now,
              const std::vector<double>* before = nullptr, int64_t pull_limit = -1,
              const std::vector<double>* stall = nullptr);

}  // namespace route
