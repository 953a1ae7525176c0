// Python binding of the router's decision (decide.hpp): WorkerState (a worker's figures, the
// counters the request path keeps), Heat, and Decider, whose `decide` walks a prompt tree once
// for every candidate worker and returns the choice in one call.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "bind_common.hpp"
#include "decide.hpp"

using namespace radix_py;

namespace {

double monotonic_now() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<double>(ts.tv_sec * 1000000000LL + ts.tv_nsec) / 1e9;
}

// A clock as the tree reads one: time.monotonic itself without the call, else called.
struct Clock {
    nb::object fn;
    bool monotonic = true;

    explicit Clock(nb::object clock) {
        if (clock.is_none()) clock = nb::borrow(g_monotonic);
        if (!PyCallable_Check(clock.ptr())) raise(PyExc_TypeError, "clock must be callable");
        monotonic = clock.ptr() == g_monotonic;
        fn = std::move(clock);
    }
    double operator()() const {
        if (monotonic) return monotonic_now();
        nb::object t = fn();
        double v = PyFloat_AsDouble(t.ptr());
        if (v == -1.0 && PyErr_Occurred()) throw nb::python_error();
        return v;
    }
};

struct PyWorkerState {
    route::WorkerState s;
    // its keys in the prompt trees (router.trees): device, host tier, and home
    nb::object device_key, host_key, home_key;
};

struct PyHeat {
    Clock clock;
    route::Heat heat;
    std::vector<uint32_t> scratch;

    PyHeat(uint32_t page_size, double half_life_s, size_t max_entries, nb::object clk)
        : clock(std::move(clk)), heat(page_size, half_life_s, max_entries, clock()) {}
};

PyObject* g_reasons[10];  // interned, owned for the process's life

nb::object reason_str(route::Reason r) { return nb::borrow(g_reasons[static_cast<int>(r)]); }

double checked_positive(double v, const char* what) {
    if (!(v > 0) || !std::isfinite(v)) {
        raise(PyExc_ValueError, std::string(what) + " must be a positive number, got " +
                                    std::to_string(v));
    }
    return v;
}

double checked_cost(double v, const char* what) {
    if (!(v >= 0) || !std::isfinite(v)) {
        raise(PyExc_ValueError, std::string(what) + " must be a non-negative number, got " +
                                    std::to_string(v));
    }
    return v;
}

struct Decider {
    route::Settings settings;
    nb::object heat_obj;  // a Heat, or None (the cost rule keeps none)
    std::vector<uint32_t> scratch;

    PyHeat* heat() { return heat_obj.is_none() ? nullptr : nb::cast<PyHeat*>(heat_obj); }

    std::vector<const route::WorkerState*> states(nb::handle workers,
                                                  std::vector<PyWorkerState*>& out) {
        nb::object seq = nb::steal(PySequence_Fast(workers.ptr(), "workers must be a list"));
        if (!seq.is_valid()) throw nb::python_error();
        Py_ssize_t k = PySequence_Fast_GET_SIZE(seq.ptr());
        if (k == 0) raise(PyExc_ValueError, "decide needs at least one worker");
        PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
        std::vector<const route::WorkerState*> ws(k);
        out.resize(k);
        for (Py_ssize_t i = 0; i < k; i++) {
            if (!nb::isinstance<PyWorkerState>(items[i])) {
                raise(PyExc_TypeError,
                      "workers must be WorkerState objects, got " + type_name(items[i]));
            }
            out[i] = nb::cast<PyWorkerState*>(nb::handle(items[i]));
            ws[i] = &out[i]->s;
        }
        return ws;
    }

    // Seconds per worker (None: none), checked; `name` is the argument's, for the errors
    // (`not_list`: the TypeError's message, a literal: built on every call, it would cost a
    // decision an allocation).
    static std::vector<double> seconds_each(nb::handle seconds, size_t k, const char* name,
                                            const char* not_list) {
        std::vector<double> out;
        if (seconds.is_none()) return out;
        nb::object seq = nb::steal(PySequence_Fast(seconds.ptr(), not_list));
        if (!seq.is_valid()) throw nb::python_error();
        if (static_cast<size_t>(PySequence_Fast_GET_SIZE(seq.ptr())) != k) {
            raise(PyExc_ValueError, std::string(name) + " needs one number of seconds per worker");
        }
        out.resize(k);
        for (size_t i = 0; i < k; i++) {
            double v = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq.ptr(), i));
            if (v == -1.0 && PyErr_Occurred()) throw nb::python_error();
            if (!std::isfinite(v) || v < 0) {
                raise(PyExc_ValueError,
                      std::string(name) + ": seconds must be finite and not negative");
            }
            out[i] = v;
        }
        return out;
    }

    nb::tuple run(const std::vector<PyWorkerState*>& py,
                  const std::vector<const route::WorkerState*>& ws,
                  const std::vector<route::Held>& held, const uint32_t* tokens, size_t n,
                  int64_t num_tokens, const std::vector<double>& before, int64_t pull_limit,
                  const std::vector<double>& stall) {
        if (num_tokens < 0) raise(PyExc_ValueError, "num_tokens must not be negative");
        if (pull_limit < -1) {
            raise(PyExc_ValueError, "pull_limit must be -1 (no limit) or a number of tokens >= 0");
        }
        PyHeat* h = settings.rule == route::Rule::PromptTree ? heat() : nullptr;
        double heat_now = h ? h->clock() : 0.0;
        route::Choice c = route::decide(settings, ws, held, tokens, n, num_tokens,
                                        h ? &h->heat : nullptr, monotonic_now(), heat_now,
                                        before.empty() ? nullptr : &before, pull_limit,
                                        stall.empty() ? nullptr : &stall);
        if (settings.rule == route::Rule::PromptTree) py[c.worker]->s.draw(c.computed, heat_now);
        nb::list holders;
        for (const auto& [i, tokens_held] : c.holders) {
            holders.append(nb::make_tuple(i, tokens_held));
        }
        nb::object pull = c.pull_from < 0 ? nb::object(nb::none()) : nb::object(nb::int_(c.pull_from));
        return nb::make_tuple(c.worker, reason_str(c.reason), c.predicted_cached, holders, pull,
                              nb::make_tuple(c.work.queue_s, c.work.tokens_s, c.work.pairs_s,
                                             c.work.moved_s, c.work.fixed_s));
    }

    // One walk of `tree` for every candidate, then the rule.
    nb::tuple decide(nb::handle tree, nb::handle tokens, int64_t num_tokens, nb::handle workers,
                     nb::handle ttl, nb::handle before_s, int64_t pull_limit,
                     nb::handle stall_s) {
        std::shared_ptr<Core> core = tree_core(tree);
        if (core->tree.page_size() != settings.page_size) {
            raise(PyExc_ValueError, "the tree's page size is not the decider's");
        }
        std::vector<PyWorkerState*> py;
        std::vector<const route::WorkerState*> ws = states(workers, py);
        std::vector<route::Held> held(ws.size());
        std::vector<double> before =
            seconds_each(before_s, ws.size(), "before", "before must be a list");
        std::vector<double> stall =
            seconds_each(stall_s, ws.size(), "stall", "stall must be a list");
        Py_ssize_t len = PyObject_Length(tokens.ptr());
        if (len < 0) PyErr_Clear();
        if (len == 0) {
            return run(py, ws, held, nullptr, 0, num_tokens, before, pull_limit, stall);
        }
        Tokens t(tokens, core->scratch, core->tree.page_size());
        double now = core->now();
        double cutoff = -std::numeric_limits<double>::infinity();
        if (!ttl.is_none()) cutoff = now - nb::cast<double>(ttl);
        std::vector<std::pair<HolderId, int64_t>> found;
        core->tree.holders(t.data(), t.whole(), now, cutoff, found);
        if (!found.empty()) {
            auto tokens_of = [&](nb::handle key) -> int64_t {
                if (!key.is_valid() || key.is_none()) return -1;
                HolderId id = core->find_holder(key);
                if (id == kNone) return -1;
                for (const auto& [h, v] : found) {
                    if (h == id) return v;
                }
                return -1;
            };
            for (size_t i = 0; i < ws.size(); i++) {
                int64_t device = tokens_of(py[i]->device_key);
                int64_t host = tokens_of(py[i]->host_key);
                held[i] = route::Held{std::max(device, host), device, tokens_of(py[i]->home_key)};
            }
        }
        // every id, for the heat
        return run(py, ws, held, t.data(), t.size(), num_tokens, before, pull_limit, stall);
    }

    // The same rule over a view given per worker as (held in any tier, on device, home),
    // -1 for none: trees that are not a RadixTree (a replay's exact caches).
    nb::tuple decide_view(nb::handle view, nb::handle tokens, int64_t num_tokens,
                          nb::handle workers, nb::handle before_s, int64_t pull_limit,
                          nb::handle stall_s) {
        std::vector<PyWorkerState*> py;
        std::vector<const route::WorkerState*> ws = states(workers, py);
        nb::object seq = nb::steal(PySequence_Fast(view.ptr(), "view must be a list"));
        if (!seq.is_valid()) throw nb::python_error();
        if (static_cast<size_t>(PySequence_Fast_GET_SIZE(seq.ptr())) != ws.size()) {
            raise(PyExc_ValueError, "view needs one (any, device, home) entry per worker");
        }
        std::vector<route::Held> held(ws.size());
        for (size_t i = 0; i < ws.size(); i++) {
            auto entry = nb::cast<std::tuple<int64_t, int64_t, int64_t>>(
                nb::handle(PySequence_Fast_GET_ITEM(seq.ptr(), i)));
            held[i] = route::Held{std::get<0>(entry), std::get<1>(entry), std::get<2>(entry)};
        }
        std::vector<double> before =
            seconds_each(before_s, ws.size(), "before", "before must be a list");
        std::vector<double> stall =
            seconds_each(stall_s, ws.size(), "stall", "stall must be a list");
        Py_ssize_t len = PyObject_Length(tokens.ptr());
        if (len < 0) PyErr_Clear();
        if (len == 0) {
            return run(py, ws, held, nullptr, 0, num_tokens, before, pull_limit, stall);
        }
        Tokens t(tokens, scratch, 1);
        return run(py, ws, held, t.data(), t.size(), num_tokens, before, pull_limit, stall);
    }
};

}  // namespace

void radix_py::bind_decide(nb::module_& m) {
    for (int r = 0; r < 10; r++) {
        PyObject* name = PyUnicode_FromString(route::reason_name(static_cast<route::Reason>(r)));
        if (!name) throw nb::python_error();
        PyUnicode_InternInPlace(&name);  // the metrics' label lookups find it at once
        g_reasons[r] = name;
    }

    nb::class_<PyWorkerState>(m, "WorkerState",
                              "One worker's figures as the decision reads them: the router's "
                              "counters, the worker's reports, its learned speed.")
        .def(
            "__init__",
            [](PyWorkerState* self, nb::object url, bool prefill) {
                new (self) PyWorkerState();
                self->s.prefill = prefill;
                if (!url.is_none()) {
                    if (!PyUnicode_Check(url.ptr())) {
                        raise(PyExc_TypeError, "url must be a str, got " + type_name(url.ptr()));
                    }
                    self->device_key = url;
                    self->host_key = nb::make_tuple(url, "host");
                    self->home_key = nb::make_tuple(url, "home");
                }
            },
            nb::arg("url") = nb::none(), nb::arg("prefill") = false)
        .def_prop_ro("url", [](PyWorkerState& w) { return w.device_key; })
        .def_prop_ro("prefill", [](PyWorkerState& w) { return w.s.prefill; })
#define MEMSERVE_FIELD(name) .def_prop_rw(                                    \
    #name, [](PyWorkerState& w) { return w.s.name; },                             \
    [](PyWorkerState& w, decltype(route::WorkerState::name) v) { w.s.name = v; })
        MEMSERVE_FIELD(in_flight)
        MEMSERVE_FIELD(in_flight_tokens)
        MEMSERVE_FIELD(peer_in_flight)
        MEMSERVE_FIELD(peer_in_flight_tokens)
        MEMSERVE_FIELD(reported_reqs)
        MEMSERVE_FIELD(reported_waiting)
        MEMSERVE_FIELD(reported_pending_tokens)
        MEMSERVE_FIELD(report_asks)
        MEMSERVE_FIELD(reported_ended)
        MEMSERVE_FIELD(unstarted)
        MEMSERVE_FIELD(pulls_served)
        MEMSERVE_FIELD(has_agent)
        MEMSERVE_FIELD(can_pull)
        MEMSERVE_FIELD(free_tokens)
        MEMSERVE_FIELD(in_flight_fixed_s)
        MEMSERVE_FIELD(overhead_s)
        MEMSERVE_FIELD(queue_x)
        MEMSERVE_FIELD(token_x)
        MEMSERVE_FIELD(pair_x)
        MEMSERVE_FIELD(transfer_x)
        MEMSERVE_FIELD(drawn)
        MEMSERVE_FIELD(drawn_at)
#undef MEMSERVE_FIELD
        .def_prop_ro("load", [](PyWorkerState& w) { return w.s.load(); })
        .def_prop_ro("queued_tokens", [](PyWorkerState& w) { return w.s.queued_tokens(); })
        .def_prop_ro("waiting", [](PyWorkerState& w) { return w.s.waiting(); })
        .def_prop_ro("finished", [](PyWorkerState& w) { return w.s.finished(); })
        .def(
            "finish",
            [](PyWorkerState& w, nb::handle at) {
                w.s.finish(at.is_none() ? monotonic_now() : nb::cast<double>(at));
            },
            nb::arg("at") = nb::none())
        .def(
            "service_rate",
            [](PyWorkerState& w, nb::handle now) -> nb::object {
                double rate = 0;
                if (!w.s.service_rate(now.is_none() ? monotonic_now() : nb::cast<double>(now),
                                      rate)) {
                    return nb::none();
                }
                return nb::float_(rate);
            },
            nb::arg("now") = nb::none())
        .def(
            "measured_wait_s",
            [](PyWorkerState& w, nb::handle now) {
                return w.s.measured_wait_s(now.is_none() ? monotonic_now()
                                                         : nb::cast<double>(now));
            },
            nb::arg("now") = nb::none());

    nb::class_<PyHeat>(m, "Heat",
                       "Decayed counts of requests per prefix (its length and last page).")
        .def(
            "__init__",
            [](PyHeat* self, int64_t page_size, double half_life_s, int64_t max_entries,
               nb::object clock) {
                if (page_size < 1 || page_size > (1 << 20)) {
                    raise(PyExc_ValueError, "page_size must lie in 1..1048576");
                }
                if (max_entries < 1) raise(PyExc_ValueError, "max_entries must be positive");
                checked_positive(half_life_s, "half_life_s");
                new (self) PyHeat(static_cast<uint32_t>(page_size), half_life_s,
                                  static_cast<size_t>(max_entries), std::move(clock));
            },
            nb::arg("page_size") = 16, nb::arg("half_life_s") = 30.0,
            nb::arg("max_entries") = 1 << 14, nb::arg("clock") = nb::none())
        .def(
            "bump",
            [](PyHeat& h, nb::handle tokens, int64_t length) {
                Py_ssize_t len = PyObject_Length(tokens.ptr());
                if (len < 0) PyErr_Clear();
                double now = h.clock();
                if (len == 0) return h.heat.bump(nullptr, 0, length, now);
                Tokens t(tokens, h.scratch, 1);
                return h.heat.bump(t.data(), t.size(), length, now);
            },
            nb::arg("tokens"), nb::arg("length"))
        .def("share", [](PyHeat& h, double heat) { return h.heat.share(heat); }, nb::arg("heat"))
        .def_prop_ro("before", [](PyHeat& h) { return h.heat.before(); })
        .def_prop_ro("page_size", [](PyHeat& h) { return h.heat.page_size(); })
        .def("__len__", [](PyHeat& h) { return h.heat.size(); });

    nb::class_<Decider>(m, "Decider",
                        "The prompt_tree or cost rule with the cost model's constants.")
        .def(
            "__init__",
            [](Decider* self, const std::string& rule, int64_t page_size, bool pulls,
               int64_t balance_abs, double balance_rel, double prefill_s_per_token,
               double transfer_s_per_token, double busy_s_per_request,
               double host_load_s_per_token, double prefill_s_per_token_pair,
               nb::object heat) {
                route::Settings s;
                if (rule == "prompt_tree") {
                    s.rule = route::Rule::PromptTree;
                } else if (rule == "cost") {
                    s.rule = route::Rule::Cost;
                } else {
                    raise(PyExc_ValueError, "rule must be 'prompt_tree' or 'cost', got '" + rule + "'");
                }
                if (page_size < 1 || page_size > (1 << 20)) {
                    raise(PyExc_ValueError, "page_size must lie in 1..1048576");
                }
                s.page_size = static_cast<uint32_t>(page_size);
                s.pulls = pulls;
                s.thresholds.balance_abs = balance_abs;
                s.thresholds.balance_rel = checked_cost(balance_rel, "balance_rel");
                s.costs.prefill_s_per_token = checked_cost(prefill_s_per_token, "prefill_s_per_token");
                s.costs.transfer_s_per_token =
                    checked_cost(transfer_s_per_token, "transfer_s_per_token");
                s.costs.busy_s_per_request = checked_cost(busy_s_per_request, "busy_s_per_request");
                s.costs.host_load_s_per_token =
                    checked_cost(host_load_s_per_token, "host_load_s_per_token");
                s.costs.prefill_s_per_token_pair =
                    checked_cost(prefill_s_per_token_pair, "prefill_s_per_token_pair");
                if (!heat.is_none() && !nb::isinstance<PyHeat>(heat)) {
                    raise(PyExc_TypeError, "heat must be a Heat or None");
                }
                new (self) Decider{s, std::move(heat), {}};
            },
            nb::arg("rule"), nb::arg("page_size"), nb::arg("pulls"), nb::arg("balance_abs"),
            nb::arg("balance_rel"), nb::arg("prefill_s_per_token"),
            nb::arg("transfer_s_per_token"), nb::arg("busy_s_per_request"),
            nb::arg("host_load_s_per_token"), nb::arg("prefill_s_per_token_pair"),
            nb::arg("heat") = nb::none())
        .def_prop_rw(
            "heat", [](Decider& d) { return d.heat_obj; },
            [](Decider& d, nb::object heat) {
                if (!heat.is_none() && !nb::isinstance<PyHeat>(heat)) {
                    raise(PyExc_TypeError, "heat must be a Heat or None");
                }
                d.heat_obj = std::move(heat);
            })
        .def_prop_ro("page_size", [](Decider& d) { return d.settings.page_size; })
        .def("decide", &Decider::decide, nb::arg("tree"), nb::arg("tokens"),
             nb::arg("num_tokens"), nb::arg("workers"), nb::arg("ttl") = nb::none(),
             nb::arg("before") = nb::none(), nb::arg("pull_limit") = -1,
             nb::arg("stall") = nb::none())
        .def("decide_view", &Decider::decide_view, nb::arg("view"), nb::arg("tokens"),
             nb::arg("num_tokens"), nb::arg("workers"), nb::arg("before") = nb::none(),
             nb::arg("pull_limit") = -1, nb::arg("stall") = nb::none())
        .def(
            "plan",
            [](Decider& d, PyWorkerState& w, int64_t num_tokens, int64_t cached, int64_t host,
               PyWorkerState* source, int64_t best, nb::handle load) {
                if (num_tokens < 1 || cached < 0 || cached > num_tokens || host < 0 ||
                    best < 0 || best > num_tokens) {
                    raise(PyExc_ValueError, "plan needs 0 <= cached, best <= num_tokens, "
                                            "num_tokens >= 1 and host >= 0");
                }
                int64_t l = load.is_none() ? w.s.load() : nb::cast<int64_t>(load);
                route::Plan p = route::plan(d.settings.costs, w.s, num_tokens, cached, host,
                                            source ? &source->s : nullptr, best, l,
                                            monotonic_now());
                return nb::make_tuple(p.seconds, p.computed, p.pull,
                                      nb::make_tuple(p.work.queue_s, p.work.tokens_s,
                                                     p.work.pairs_s, p.work.moved_s,
                                                     p.work.fixed_s));
            },
            nb::arg("worker"), nb::arg("num_tokens"), nb::arg("cached"), nb::arg("host") = 0,
            nb::arg("source") = nb::none(), nb::arg("best") = 0, nb::arg("load") = nb::none())
        .def(
            "queue_s",
            [](Decider& d, PyWorkerState& w, int64_t host, nb::handle load) {
                int64_t l = load.is_none() ? w.s.load() : nb::cast<int64_t>(load);
                return route::queue_s(d.settings.costs, w.s, host, l, monotonic_now(), nullptr);
            },
            nb::arg("worker"), nb::arg("host") = 0, nb::arg("load") = nb::none());
}
