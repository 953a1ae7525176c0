// The router's decision (decide.hpp). Ties go to the first worker, as Python's min() and max()
// give them, so the reference model in the tests decides the same on the same input.
#include "decide.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace route {

namespace {

// Tokens of an `n`-token prompt an engine holding `held` of it reuses: whole pages only, and
// never the last prompt token, which it always computes (none of a prompt not counted yet).
int64_t reusable(int64_t held, int64_t n, int64_t page) {
    return std::max<int64_t>(std::min(held, n - 1), 0) / page * page;
}

struct Terms {
    double tokens_s, pairs_s;
};

Terms prefill_terms(const Costs& c, int64_t fresh, int64_t cached) {
    double nf = static_cast<double>(fresh);
    return {nf * c.prefill_s_per_token,
            nf * (static_cast<double>(cached) + nf / 2) * c.prefill_s_per_token_pair};
}

}  // namespace

Plan plan(const Costs& c, const WorkerState& w, int64_t n, int64_t cached, int64_t host,
          const WorkerState* source, int64_t best, int64_t load, double now) {
    double work = 0;
    double queue = queue_s(c, w, host, load, now, &work);
    // modelled, not learned: its own host-tier load, and the loads queued ahead of it
    double loading = static_cast<double>(host) * c.host_load_s_per_token + w.in_flight_fixed_s;
    Terms own_t = prefill_terms(c, n - cached, cached);
    Plan own{queue + w.prefill_s(own_t.tokens_s, own_t.pairs_s), n - cached, false,
             {work, own_t.tokens_s, own_t.pairs_s, 0.0, loading}};
    if (source == nullptr || best <= cached || !w.can_pull) return own;
    double moved = static_cast<double>(best - cached) * c.transfer_s_per_token *
                   static_cast<double>(1 + source->pulls_served);
    Terms t = prefill_terms(c, n - best, best);
    double pull = queue + moved * w.transfer_x + w.prefill_s(t.tokens_s, t.pairs_s);
    if (pull >= own.seconds) return own;
    return Plan{pull, n - best, true, {work, t.tokens_s, t.pairs_s, moved, loading}};
}

// ------------------------------------------------------------------ a worker's figures

// A report is a snapshot: each of this router's requests in it answered since took one
// request out of it, and let one that waited begin.
int64_t WorkerState::reported_left() const {
    return std::max<int64_t>(reported_reqs + reported_waiting - reported_ended, 0);
}

int64_t WorkerState::load() const {
    return std::max(in_flight + peer_in_flight, reported_left());
}

// The reported queued tokens in the share of the reported requests still there.
int64_t WorkerState::queued_tokens() const {
    int64_t reported = reported_reqs + reported_waiting, pending = reported_pending_tokens;
    if (reported > 0 && pending > 0 && reported_ended > 0) {
        double left = static_cast<double>(reported_left()) / static_cast<double>(reported);
        pending = static_cast<int64_t>(static_cast<double>(pending) * left);
    }
    return std::max(in_flight_tokens + peer_in_flight_tokens, pending);
}

static int64_t reported_waiting_left(const WorkerState& w) {
    return std::max<int64_t>(w.reported_waiting - w.reported_ended, 0);
}

int64_t WorkerState::waiting() const { return std::max(unstarted, reported_waiting_left(*this)); }

void WorkerState::finish(double at) {
    if (finished_n_ < kRateWindow) {
        finished_at_[(finished_head_ + finished_n_) % kRateWindow] = at;
        finished_n_++;
    } else {
        finished_at_[finished_head_] = at;
        finished_head_ = (finished_head_ + 1) % kRateWindow;
    }
}

double WorkerState::finished(int i) const {
    return finished_at_[(finished_head_ + i) % kRateWindow];
}

// Requests it finished per second lately; a worker that stopped finishing any is slower than
// its last ones say.
bool WorkerState::service_rate(double now, double& rate) const {
    if (finished_n_ < kMinRateSamples) return false;
    double first = finished(0), last = finished(finished_n_ - 1);
    double span = std::max(last - first, 1e-3);
    double lately = std::max(now - first, span);
    rate = std::min((finished_n_ - 1) / span, finished_n_ / lately);
    return true;
}

// The requests waiting ahead of a new one over the rate it serves them; of this router's
// requests not begun, the oldest is taken as being prefilled.
double WorkerState::measured_wait_s(double now) const {
    int64_t waiting = std::max(unstarted - 1, reported_waiting_left(*this));
    if (waiting <= 0) return 0.0;
    double rate = 0;
    if (!service_rate(now, rate) || rate == 0) return 0.0;
    return static_cast<double>(waiting) / rate;
}

double WorkerState::drawn_now(double now) const {
    return drawn * std::exp2(-std::max(now - drawn_at, 0.0) / kDrawnHalfLifeS);
}

void WorkerState::draw(int64_t tokens, double now) {
    drawn = drawn_now(now) + static_cast<double>(std::max<int64_t>(tokens, 0));
    drawn_at = now;
}

double queue_s(const Costs& c, const WorkerState& w, int64_t host, int64_t load, double now,
               double* work_out) {
    double work = static_cast<double>(w.queued_tokens()) * c.prefill_s_per_token +
                  static_cast<double>(load) * c.busy_s_per_request;
    double modelled = work * w.queue_x + w.in_flight_fixed_s;
    if (!w.prefill && w.waiting()) modelled = std::max(modelled, w.measured_wait_s(now));
    if (work_out) *work_out = work;
    return modelled + static_cast<double>(host) * c.host_load_s_per_token;
}

// ------------------------------------------------------------------ prefix heat

Heat::Heat(uint32_t page_size, double half_life_s, size_t max_entries, double now)
    : ps_(page_size), rate_(std::log(2.0) / half_life_s), max_entries_(max_entries),
      total_at_(now) {}

double Heat::bump(const uint32_t* tokens, size_t n, int64_t length, double now) {
    before_ = total_ * std::exp(-rate_ * (now - total_at_));
    total_ = before_ + 1.0;
    total_at_ = now;
    if (length < static_cast<int64_t>(ps_) || static_cast<size_t>(length) > n) return 0.0;
    std::string key(sizeof(int64_t) + ps_ * sizeof(uint32_t), '\0');
    std::memcpy(key.data(), &length, sizeof(int64_t));
    std::memcpy(key.data() + sizeof(int64_t), tokens + (length - ps_), ps_ * sizeof(uint32_t));
    double count = 0.0;
    auto it = counts_.find(key);
    if (it != counts_.end()) {
        count = it->second.count * std::exp(-rate_ * (now - it->second.at));
        order_.erase(it->second.order);
        counts_.erase(it);
    }
    order_.push_back(key);
    counts_.emplace(std::move(key), Entry{count + 1.0, now, std::prev(order_.end())});
    if (counts_.size() > max_entries_) {  // the least recently seen goes
        counts_.erase(order_.front());
        order_.pop_front();
    }
    return count;
}

// ------------------------------------------------------------------ the decision

const char* reason_name(Reason r) {
    switch (r) {
        case Reason::CacheHit: return "cache_hit";
        case Reason::CacheMiss: return "cache_miss";
        case Reason::HostHit: return "host_hit";
        case Reason::Home: return "home";
        case Reason::HomeBusy: return "home_busy";
        case Reason::Overload: return "overload";
        case Reason::Pull: return "pull";
        case Reason::OverloadPull: return "overload_pull";
        case Reason::HomeBusyPull: return "home_busy_pull";
        case Reason::HomePull: return "home_pull";
    }
    return "policy";
}

namespace {

Reason pulled(Reason r) {
    switch (r) {
        case Reason::CacheHit: case Reason::CacheMiss: return Reason::Pull;
        case Reason::Overload: return Reason::OverloadPull;
        case Reason::HomeBusy: return Reason::HomeBusyPull;
        case Reason::Home: return Reason::HomePull;
        default: return r;
    }
}

struct Options {
    std::vector<int64_t> held, loads, host;
    std::vector<Plan> plans;
    size_t best = 0;       // the holder of the longest prefix
    int64_t pullable = 0;  // of it, what a pull may cover
};

Options options(const Settings& s, const std::vector<const WorkerState*>& ws,
                const std::vector<Held>& view, int64_t n, double now,
                const std::vector<double>* before, int64_t pull_limit) {
    Options o;
    size_t k = ws.size();
    int64_t page = s.page_size;
    o.held.resize(k);
    o.loads.resize(k);
    o.host.resize(k);
    int64_t key_held = 0, key_load = 0;
    for (size_t i = 0; i < k; i++) {
        int64_t found = std::max<int64_t>(view[i].any, 0);
        int64_t mine = reusable(found, n, page);
        o.held[i] = mine;
        o.loads[i] = ws[i]->load();
        // (mine, -load) > the best's: more held, or as much and less loaded
        if (i == 0 || mine > key_held || (mine == key_held && -o.loads[i] > key_load)) {
            o.best = i;
            key_held = mine;
            key_load = -o.loads[i];
        }
        o.host[i] = std::max<int64_t>(found - std::max<int64_t>(view[i].device, 0), 0);
    }
    int64_t most = o.held[o.best];
    o.pullable = pull_limit < 0 ? most : std::min(most, pull_limit);
    const WorkerState* source =
        s.pulls && o.pullable && ws[o.best]->has_agent ? ws[o.best] : nullptr;
    o.plans.reserve(k);
    for (size_t i = 0; i < k; i++) {
        int64_t host = std::min(o.host[i], o.held[i]);
        const WorkerState* from = source != ws[i] ? source : nullptr;
        o.plans.push_back(
            plan(s.costs, *ws[i], n, o.held[i], host, from, o.pullable, o.loads[i], now));
        if (before) {  // paid before its prefill, modelled and not learned
            o.plans[i].seconds += (*before)[i];
            o.plans[i].work.fixed_s += (*before)[i];
        }
    }
    return o;
}

Choice choose(const Settings& s, const std::vector<const WorkerState*>& ws, const Options& o,
              size_t choice, Reason reason) {
    Choice c;
    c.worker = choice;
    int64_t mine = o.held[choice];
    const Plan& p = o.plans[choice];
    if (p.pull) {
        reason = pulled(reason);
    } else if (reason == Reason::CacheHit && o.host[choice]) {
        reason = Reason::HostHit;
    }
    c.reason = reason;
    c.predicted_cached = mine;
    if (s.pulls && ws[choice]->can_pull && o.pullable > mine) {
        for (size_t i = 0; i < ws.size(); i++) {
            if (i != choice && ws[i]->has_agent && o.held[i] > mine) {
                c.holders.emplace_back(i, o.held[i]);
            }
        }
        std::stable_sort(c.holders.begin(), c.holders.end(),
                         [](const auto& a, const auto& b) { return a.second > b.second; });
    }
    c.pull_from = p.pull ? static_cast<int64_t>(o.best) : -1;
    c.computed = p.computed;
    c.work = p.work;
    return c;
}

// Where a new prefix goes (decide.hpp): of the workers expected to start it at most
// kFreshBand times as late as the soonest and at most kFreshSpeedBand times slower than the
// fastest of them, where the fewest wait, then the least work drawn, then the fewest requests.
size_t fresh(const std::vector<const WorkerState*>& ws, const std::vector<int64_t>& loads,
             const std::vector<double>& placement, size_t soonest, double now) {
    double latest = placement[soonest] * kFreshBand;
    size_t k = ws.size(), choice = k;
    double fastest = ws[soonest]->token_x;  // the soonest is in the band
    for (size_t i = 0; i < k; i++) {
        if (placement[i] <= latest) fastest = std::min(fastest, ws[i]->token_x);
    }
    double least = 0;
    for (size_t i = 0; i < k; i++) {
        if (placement[i] > latest || ws[i]->token_x > fastest * kFreshSpeedBand) continue;
        double work = ws[i]->drawn_now(now) * ws[i]->token_x;
        int64_t waiting = ws[i]->waiting();
        bool better = choice == k || waiting < ws[choice]->waiting();
        if (!better && waiting == ws[choice]->waiting()) {
            better = work < least || (work == least && loads[i] < loads[choice]);
        }
        if (better) {
            choice = i;
            least = work;
        }
    }
    return choice;
}

}  // namespace

Choice decide(const Settings& s, const std::vector<const WorkerState*>& ws,
              const std::vector<Held>& view, const uint32_t* tokens, size_t n,
              int64_t num_tokens, Heat* heat, double now, double heat_now,
              const std::vector<double>* before, int64_t pull_limit,
              const std::vector<double>* stall) {
    Options o = options(s, ws, view, num_tokens, now, before, pull_limit);
    size_t k = ws.size();
    if (s.rule == Rule::Cost) {
        size_t choice = 0;
        for (size_t i = 1; i < k; i++) {
            const Plan& a = o.plans[i];
            const Plan& b = o.plans[choice];
            if (a.seconds < b.seconds || (a.seconds == b.seconds && o.loads[i] < o.loads[choice])) {
                choice = i;
            }
        }
        return choose(s, ws, o, choice, o.held[choice] ? Reason::CacheHit : Reason::CacheMiss);
    }
    // Where the prefix lives, or lived last: a prefix evicted everywhere is computed again
    // where it lived rather than scattered.
    int64_t page = s.page_size;
    std::vector<int64_t> affinity = o.held;
    size_t best = o.best;
    bool homes = false;
    for (size_t i = 0; i < k; i++) {
        if (view[i].home >= 0) {
            homes = true;
            affinity[i] = std::max(o.held[i], reusable(view[i].home, num_tokens, page));
        }
    }
    if (homes) {  // max by (affinity, held, -load), the first of equals
        best = 0;
        for (size_t i = 1; i < k; i++) {
            if (affinity[i] != affinity[best]) {
                if (affinity[i] > affinity[best]) best = i;
            } else if (o.held[i] != o.held[best]) {
                if (o.held[i] > o.held[best]) best = i;
            } else if (o.loads[i] < o.loads[best]) {
                best = i;
            }
        }
    }
    int64_t most = affinity[best];
    // Expected TTFT on each worker, plus the prefix it lacks, paid once more: recomputed,
    // that work delays every request queued behind it; pulled, the copy displaces as much of
    // other requests' cache there, which they recompute later. So leaving a holder must win
    // by more than this request's own TTFT, pull or not (measured: scoring pulls as free
    // moved 42% of multi-round QA turns off their holders and halved the host-tier hits).
    // A prefix many requests reuse pays for its copy over all of them, while it has fewer
    // copies than its share of the traffic needs workers (Heat); but only the part of the
    // copy that fits in the worker's free KV: the rest evicts cache as hot as what the
    // eviction order keeps (measured: with caches half the hot set, heat-discounted pulls
    // into full caches evicted the other hot prefixes, hit ratio 0.92 -> 0.77-0.87).
    // Likewise an adapter's load (`stall`): the engine loads it in the step that prefills
    // the request, which holds up every request waiting there too (measured on the LoRA
    // preset: 15% fewer loads a request, mean TTFT 5% lower, over 3 seeds twice). Only the
    // load: a wait for a busy worker's adapter slot is the request's alone (the engine runs
    // the others meanwhile); charged once per request waiting there too (seconds each in the
    // LoRA preset's cold start), it sent a hot adapter's requests to its one holder.
    // But a copy into an idle worker (nothing in flight, nothing waiting) whose free KV holds
    // it displaces no cache and holds up no one: it costs its own TTFT only (measured on the
    // tenants preset: charged, an empty worker lacking the public prefix every prompt starts
    // with got none of 240 requests while the others queued). Only idle: with "no one
    // waiting" alone, multi-round QA at 9 req/s lost 7 points of hit ratio and its mean TTFT
    // went 0.43 -> 0.66-0.69 s (two runs against one): free KV on a busy worker is likely
    // the room its running sessions are about to grow into.
    // And the part of the prompt no worker holds, where requests queue behind the one being
    // prefilled: the engine prefills them together in its next step, so each of them waits
    // for that compute too (the first of those counted as waiting is taken as the one being
    // prefilled). Measured on the LoRA preset: seed 2's p99 went from 1.26-1.37 s in five
    // runs to 1.11-1.12 s in six of seven (2.08 s in one), seed 1's from 0.94-1.08 to
    // 0.81-0.98 s; a cached prompt's first token no longer waits for a long cold one sent to
    // the same worker after it.
    double h = heat ? heat->bump(tokens, n, most, heat_now) : 0.0;
    if (h) {  // a hot prefix with copies enough: one more only displaces other cache
        int64_t copies = 0;
        for (int64_t a : affinity) copies += a >= most;
        if (static_cast<double>(copies) >= heat->share(h) * static_cast<double>(k)) h = 0.0;
    }
    std::vector<double> placement(k);
    size_t soonest = 0;
    double fresh_s = static_cast<double>(num_tokens - std::min(most, num_tokens)) *
                     s.costs.prefill_s_per_token;  // the part no worker holds, at the constants
    for (size_t i = 0; i < k; i++) {
        int64_t lacks = most - affinity[i];
        double seconds = o.plans[i].seconds;
        int64_t free = ws[i]->free_tokens;
        if (lacks && (free < lacks || o.loads[i] || ws[i]->waiting())) {
            int64_t evicts = free < 0 ? 0 : std::clamp<int64_t>(lacks - free, 0, lacks);
            double paid = static_cast<double>(evicts) + static_cast<double>(lacks - evicts) / (1 + h);
            seconds += paid * s.costs.prefill_s_per_token * ws[i]->token_x *
                       static_cast<double>(1 + ws[i]->waiting());
        }
        if (stall) seconds += (*stall)[i] * static_cast<double>(ws[i]->waiting());
        // its fresh part joins the next prefill step of the requests queued there (above)
        int64_t queued = std::max<int64_t>(ws[i]->waiting() - 1, 0);
        seconds += fresh_s * ws[i]->token_x * static_cast<double>(queued);
        placement[i] = seconds;
        if (i == 0 || seconds < placement[soonest] ||
            (seconds == placement[soonest] && o.loads[i] < o.loads[soonest])) {
            soonest = i;
        }
    }
    if (most == 0) {
        size_t choice = fresh(ws, o.loads, placement, soonest, heat_now);
        return choose(s, ws, o, choice, Reason::CacheMiss);
    }
    int64_t low = *std::min_element(o.loads.begin(), o.loads.end());
    if (s.thresholds.imbalanced(o.loads[best], low)) {  // sglang-router's rule: the lightest
        size_t lightest = k;
        for (size_t i = 0; i < k; i++) {
            if (o.loads[i] == low && (lightest == k || placement[i] < placement[lightest])) {
                lightest = i;
            }
        }
        return choose(s, ws, o, lightest, Reason::Overload);
    }
    if (soonest != best && placement[soonest] < placement[best]) {
        // to another holder of as much; off a busy holder; or, nothing being held anywhere,
        // off the prefix's busy home
        if (o.held[soonest] >= most) return choose(s, ws, o, soonest, Reason::CacheHit);
        return choose(s, ws, o, soonest, o.held[best] ? Reason::Overload : Reason::HomeBusy);
    }
    return choose(s, ws, o, best, o.held[best] ? Reason::CacheHit : Reason::Home);
}

}  // namespace route
