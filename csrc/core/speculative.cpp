// Speculative decoding with the model's MTP head (docs/model.md §7), exact: a stream drafts k tokens with the head,
// verifies them with one forward of k + 1 rows of the main model, and keeps what plain decoding would have drawn.
//
// One step, with t the last token drawn (not yet fed) at position P:
//   1. draft: the head's row (h_{P-1}, t) at P - 1 drafts d_1, then k - 1 chained rows (its own output, d_j) draft
//      d_2 .. d_k, each the most likely token of the head's logits shaped by the stream's options and history
//      (greedy drafts: they take no random numbers);
//   2. verify: the main model runs [t, d_1 .. d_k] at P .. P + k as one forward whose rows equal one-row steps
//      (Backend::exact_rows), giving the target rows p_0 .. p_k;
//   3. accept: row j draws y_j from p_j exactly as plain decoding draws that token (its rule, with the uniform
//      number plain decoding would take there: the stream's next); d_{j+1} stays when y_j equals it, else y_j is
//      the step's last token; p_k's draw when every draft stays. So the tokens are plain decoding's, token for
//      token, for any seed (a draft is accepted with probability p_j(d), what rejection sampling gives a
//      deterministic draft); penalties, bias, top-k/p and min-p shape each row with the history at that token;
//   4. commit: the state holds [t, d_1 .. d_a]: kept as verified when every draft stayed, else the DeltaNet states
//      after row a, which the verify kept (Backend::keep_state_rows; KV rows past the position are unused), or,
//      on a backend that does not keep them, the copy taken before the verify with the a + 1 rows run again
//      (replay); the head's cache gets the rows (h_{P+i}, d_{i+1}) from the verified hidden states, so it stays
//      what plain decoding leaves.
// The drawn tokens queue for next(); close() takes back any fed token the host never received (rewind). Each piece
// is written once (spec_draft, spec_accept, spec_roll_back, spec_commit; the forward and the head's rows:
// Engine::decode_rows): a lone verify runs them in next(), Engine::step_streams with the verify's rows beside other
// streams' rows in one forward (a segment over this stream's state, computed as alone).
#include "core/speculative.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>

#include "core/sampling.h"

namespace lily {
namespace {

constexpr int64_t kPlainProbe = 3;  // adaptive: plain steps timed before drafting (the fastest counts)
constexpr int64_t kWindow = 8;      // adaptive: verifies per judgement (the engine's first window warms up, unjudged)
constexpr int64_t kRetryEvery = 8;  // adaptive: after drafting did not pay, every 8th stream drafts again

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }


// The greedy draft of a row under the rule: greedy's pick, or the kept token of largest weight (lowest index on ties).
int32_t most_likely(const RowWeights& r) {
  if (r.greedy >= 0) return static_cast<int32_t>(r.greedy);
  int64_t best = r.last;
  double top = 0;
  for (size_t i = 0; i < r.w.size(); ++i)
    if (r.w[i] > top) top = r.w[i], best = static_cast<int64_t>(i);
  return static_cast<int32_t>(best);
}

// Where plain decoding would stop with a clear error (lily.NonFiniteLogitsError): a row it draws from holds NaN or
// inf. Empty when the row [V] is finite.
std::string non_finite(const float* row, int64_t V, int64_t position) {
  int64_t bad = 0;
  for (int64_t i = 0; i < V; ++i) bad += !std::isfinite(row[i]);
  if (!bad) return {};
  return "[generate] the model produced " + std::to_string(bad) + " non-finite logits (NaN or inf) after position " +
         std::to_string(position) + ": the weights or a kernel are broken (check the checkpoint: a NaN in a weight "
         "tensor does this)";
}

}  // namespace

TokenStream::SpecStats TokenStream::spec_stats() const { return spec_ ? spec_->stats : SpecStats{}; }

bool TokenStream::speculative() const { return spec_ && spec_->k > 0; }
int32_t TokenStream::spec_pending() const { return spec_->pending; }

TokenStream::RowOffer TokenStream::row_offer() const {
  if (!spec_ || ended_ || closed_) return RowOffer::None;
  const Spec& sp = *spec_;
  if (!sp.queue.empty() || !sp.error.empty() || returned_ >= opt_.max_tokens || st_.position >= eng_.max_context_)
    return RowOffer::None;
  if (sp.plain && sp.probe == 0) return RowOffer::Plain;
  return sp.adaptive ? RowOffer::Drafting : RowOffer::Verify;  // an explicit k keeps drafting, beside others too
}

// Speculative auto beside other streams: one forward for all of them beats this stream's drafts (its k was chosen
// for one stream alone), so it stops drafting; its tokens stay what they are (drafting never changes them).
void TokenStream::stop_drafting_to_join() {
  spec_->fall_back("decoded together with other streams");
  spec_->probe = 0;
}

// The draw of a plain step that fed sp.pending (its logits row [V]; the state now at `position`): queued for next(),
// or, from non-finite logits, the error next() throws.
void TokenStream::take_row_draw(const float* logits, int64_t position) {
  Spec& sp = *spec_;
  const int64_t V = eng_.cfg_.vocab;
  ++launched_;
  sp.fed.assign(1, sp.pending);
  sp.snap_position = -1;  // nothing to take back: the one fed token is the host's already
  sp.error = non_finite(logits, V, position);
  if (!sp.error.empty()) return;
  SampleOptions& so = opt_.sample;
  const int32_t y = sample_draw(logits, V, so, so.seen, so.counts, next_uniform());
  ++sp.stats.plain_steps;
  sp.queue.push_back(y);
  sp.pending = y;
}

void TokenStream::spec_begin(bool head_current) {
  Spec& sp = *spec_;
  Engine::SpecHistory& h = eng_.spec_history_;
  if (!head_current) return sp.fall_back("the state's MTP cache is behind its tokens (restored without it)");
  if (!sp.adaptive) return;
  if (!h.drafting && --h.wait > 0)
    return sp.fall_back(h.why + "; every " + std::to_string(kRetryEvery) + "th generation drafts again");
  if (!h.drafting) h.drafting = true, h.plain_s = 0;  // the retry: plain steps timed afresh
  if (h.plain_s == 0) sp.probe = kPlainProbe;
}

// Engine lock held.
int32_t TokenStream::spec_next() {
  Spec& sp = *spec_;
  if (ended_ || closed_) return -1;
  if (sp.queue.empty() && !sp.error.empty()) {
    ended_ = true;
    throw std::domain_error(sp.error);
  }
  if (sp.queue.empty()) {
    if (returned_ >= opt_.max_tokens || st_.position >= eng_.max_context_) {
      ended_ = true;
      return -1;
    }
    eng_.park_active(nullptr);  // another stream's device steps finish before this one uses the backend
    if (sp.plain || sp.probe > 0) spec_plain_step();
    else spec_iterate();
    if (sp.queue.empty()) {  // the step met non-finite logits before it drew anything
      ended_ = true;
      throw std::domain_error(sp.error);
    }
  }
  const int32_t tok = sp.queue.front();
  sp.queue.pop_front();
  ++returned_;
  for (int32_t s : opt_.stop_ids)
    if (s == tok) ended_ = true;
  if (returned_ >= opt_.max_tokens) ended_ = true;
  return tok;
}

// One plain step: feed the pending token, draw the next from its logits (the fallback, and the adaptive rule's
// measure of what a token costs without drafting).
void TokenStream::spec_plain_step() {
  Spec& sp = *spec_;
  State& st = st_;
  sp.step_logits.resize(static_cast<size_t>(eng_.cfg_.vocab));
  st.reserve(st.position + 1);
  const auto t0 = Clock::now();
  eng_.run_step(st, DecodeStep{0, sp.pending, st.position, false, 0.f}, sp.step_logits.data());
  take_row_draw(sp.step_logits.data(), st.position);
  const double dt = seconds_since(t0);
  Engine::SpecHistory& h = eng_.spec_history_;
  if (sp.probe > 0) --sp.probe, h.plain_s = h.plain_s == 0 ? dt : std::min(h.plain_s, dt);
}

void TokenStream::spec_iterate() {
  if (spec_draft() == 0) return spec_plain_step();  // no room to draft, or no head row to start
  eng_.decode_rows({this});                          // 2. - 4.: the verify alone
}

// 1. The rewind point, then k greedy drafts: Spec::rows = [t, d_1 .. d_k]. Returns k; 0 (nothing changed) when the
// stream cannot draft now.
int64_t TokenStream::spec_draft() {
  Spec& sp = *spec_;
  State& st = st_;
  Engine& e = eng_;
  const int64_t V = e.cfg_.vocab, P = st.position;
  const int64_t k = std::min<int64_t>({sp.k, opt_.max_tokens - returned_ - 1, e.max_context_ - P - 1});
  if (k < 1 || P < 1 || !st.mtp_current()) return 0;
  const auto t0 = Clock::now();
  st.reserve(P + k + 1);

  // The rewind point: DeltaNet states, the head's last hidden state and rows (KV rows past a position are unused).
  if (sp.snap_ssm.size() != st.deltanet.size()) {
    sp.snap_ssm.clear(), sp.snap_conv.clear();
    for (size_t i = 0; i < st.deltanet.size(); ++i) {
      sp.snap_ssm.emplace_back(st.mem, st.ssm_size * 4);
      sp.snap_conv.emplace_back(st.mem, std::max<int64_t>(st.conv_size, 1) * 4);
    }
    sp.snap_hidden = Buffer(st.mem, st.hidden * 4);
  }
  for (size_t i = 0; i < st.deltanet.size(); ++i) {
    st.mem->copy(sp.snap_ssm[i].data(), st.deltanet[i].ssm.data(), st.ssm_size * 4);
    if (st.conv_size) st.mem->copy(sp.snap_conv[i].data(), st.deltanet[i].conv.data(), st.conv_size * 4);
  }
  st.mem->copy(sp.snap_hidden.data(), st.last_hidden.data(), st.hidden * 4);
  sp.snap_position = P;
  sp.snap_mtp_rows = st.mtp_rows;

  // Greedy drafts; the history (penalties) takes each draft while the next is chosen, then is put back.
  SampleOptions& so = opt_.sample;
  sp.draft_logits.resize(static_cast<size_t>(k * V));
  sp.rows.assign(static_cast<size_t>(k + 1), -1);
  sp.rows[0] = sp.pending;
  std::vector<std::pair<int32_t, uint8_t>> undo;
  e.draft(st, sp.rows[0], k, sp.draft_logits.data(), sp.rows.data() + 1, [&](int64_t, const float* row) {
    const int32_t d = most_likely(sample_weights(row, V, so, so.seen, so.counts));
    undo.emplace_back(d, so.seen[d]);
    so.seen[d] = 1, so.counts[d] += 1;
    return d;
  });
  for (auto it = undo.rbegin(); it != undo.rend(); ++it) so.seen[it->first] = it->second, so.counts[it->first] -= 1;
  st.mtp_rows += 1;  // the first row, (h_{P-1}, t), is the head's row as plain decoding makes it; the rest are redone
  sp.draft_s = seconds_since(t0);
  return k;
}

// 3. Accept, from the verify's rows p_0 .. p_k (logits [k + 1, V]). Returns a; Spec::drawn is the draw that ended the
// run (-1 when a row was non-finite: Spec::error, raised once the kept drafts are returned).
int64_t TokenStream::spec_accept(const float* logits) {
  Spec& sp = *spec_;
  const int64_t V = eng_.cfg_.vocab, k = static_cast<int64_t>(sp.rows.size()) - 1, P = sp.snap_position;
  SampleOptions& so = opt_.sample;
  int64_t a = 0;
  sp.drawn = -1;
  for (int64_t j = 0; j <= k; ++j) {
    // a row plain decoding would draw from: non-finite, the stream returns the drafts accepted so far, then fails
    sp.error = non_finite(logits + j * V, V, P + j);
    if (!sp.error.empty()) break;
    // plain decoding's draw of this token: its rule (sample_draw's), its uniform number
    const int32_t drawn = sample_draw(logits + j * V, V, so, so.seen, so.counts, next_uniform());
    const int32_t d = j < k ? sp.rows[j + 1] : -1;
    if (drawn != d) {  // (the draw took the token into the history, as plain decoding's does)
      sp.drawn = drawn;
      break;
    }
    ++a;
  }
  return a;
}

void TokenStream::restore_deltanet() {
  const Spec& sp = *spec_;
  State& st = st_;
  for (size_t i = 0; i < st.deltanet.size(); ++i) {
    st.mem->copy(st.deltanet[i].ssm.data(), sp.snap_ssm[i].data(), st.ssm_size * 4);
    if (st.conv_size) st.mem->copy(st.deltanet[i].conv.data(), sp.snap_conv[i].data(), st.conv_size * 4);
  }
}

// 4. The state after [t, d_1 .. d_a], the verify having left it after all k + 1 rows: as it is when every draft
// stayed; else the DeltaNet states after row a, which a lone verify kept (rows_kept; KV rows past the position are
// unused), or the rewind point's with the position there: true, the caller runs the a + 1 rows again (replay).
bool TokenStream::spec_roll_back(int64_t a, bool rows_kept) {
  Spec& sp = *spec_;
  if (a == static_cast<int64_t>(sp.rows.size()) - 1) return false;
  if (rows_kept) {
    eng_.backend_->take_state_row(st_, a);
    st_.position = sp.snap_position + a + 1;
    return false;
  }
  restore_deltanet();
  st_.position = sp.snap_position;
  return true;
}

// 4. (cont.) Commit [t, d_1 .. d_a]: the tokens queued for next(), the stats, and the adaptive rule's window.
void TokenStream::spec_commit(int64_t a, double seconds) {
  Spec& sp = *spec_;
  const int64_t k = static_cast<int64_t>(sp.rows.size()) - 1;
  launched_ += a + 1;
  sp.fed.assign(sp.rows.begin(), sp.rows.begin() + a + 1);
  for (int64_t j = 1; j <= a; ++j) sp.queue.push_back(sp.rows[j]);
  if (sp.drawn >= 0) sp.queue.push_back(sp.drawn), sp.pending = sp.drawn;
  sp.step_tokens = a + (sp.drawn >= 0 ? 1 : 0);
  sp.stats.drafted += k;
  sp.stats.accepted += a;
  ++sp.stats.verifies;

  if (sp.adaptive) {  // the rule: a window of verifies, across streams, against the probe's plain step
    Engine::SpecHistory& h = eng_.spec_history_;
    h.window_s += seconds;
    h.window_tokens += a + 1;
    if (++h.window_verifies == kWindow) {
      const double per_token = h.window_s / static_cast<double>(h.window_tokens);
      if (h.warmed && h.plain_s > 0 && per_token > h.plain_s) {
        char why[200];
        std::snprintf(why, sizeof why,
                      "drafting did not pay (%.2f drafts accepted per verify of k = %d; %.0f us/token against %.0f "
                      "plain)", static_cast<double>(h.window_tokens - h.window_verifies) / h.window_verifies,
                      sp.k, per_token * 1e6, h.plain_s * 1e6);
        h.why = why, h.drafting = false, h.wait = kRetryEvery;
        sp.fall_back(why);
      }
      h.warmed = true;
      h.window_s = 0, h.window_tokens = 0, h.window_verifies = 0;
    }
  }
}

// Engine lock held (close): the state gives back the fed tokens the host never received, so it holds exactly the
// tokens the host knows ([t, d_1 .. d_m] after m of the queued tokens were returned).
void TokenStream::spec_rewind() {
  Spec& sp = *spec_;
  if (sp.queue.empty() || sp.snap_position < 0) return;
  const int64_t a = static_cast<int64_t>(sp.fed.size()) - 1;
  const int64_t m = sp.step_tokens - static_cast<int64_t>(sp.queue.size());  // tokens next() returned from the step
  sp.queue.clear();
  if (m >= a) return;  // every fed draft reached the host
  State& st = st_;
  Engine& e = eng_;
  restore_deltanet();
  st.mem->copy(st.last_hidden.data(), sp.snap_hidden.data(), st.hidden * 4);
  st.position = sp.snap_position;
  st.mtp_rows = sp.snap_mtp_rows;
  launched_ -= a + 1;
  const int64_t keep = m + 1;  // t and the m returned drafts
  e.run_rows(st, sp.fed.data(), keep, nullptr);
  e.advance_mtp(st, sp.fed.data(), keep, true, keep - 1, true);
  launched_ += keep;
  sp.snap_position = -1;
}

}  // namespace lily
