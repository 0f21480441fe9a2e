/*
** The trace recorder: an observer on the op call path that writes down, for the threads
** that asked, every op called at depth 0 outside backward, with its attributes and the
** ids of its inputs and outputs. Each trace owns copies of everything it recorded (names,
** integer lists), so it outlives the tensors and the ops' records.
*/
#include "ops/op.h"

#include <stdlib.h>
#include <string.h>

#define MAX_ATTRS 16

struct kiln_trace {
  kiln_trace_op *ops;
  int n, cap;
  int64_t next_synthetic; /* ids of the values inside an expanded fused op: -1, -2, ... */
  bool recording;
  struct kiln_trace *outer; /* the trace that was innermost before this one */
};

static _Thread_local kiln_trace *innermost;
static atomic_int recording_threads;

static char *dup_str(const char *s) {
  size_t n = strlen(s ? s : "") + 1;
  char *d = malloc(n);
  if (d) memcpy(d, s ? s : "", n);
  return d;
}

static void free_op(kiln_trace_op *op) {
  free((void *)op->name);
  free((void *)op->inputs);
  free((void *)op->outputs);
  for (int a = 0; a < op->n_attrs; a++) {
    free((void *)op->attrs[a].ints);
    free((void *)op->attrs[a].s);
  }
  free((void *)op->attrs);
}

/* Appends one op: name, inputs and outputs (ids), and the record's attributes when
** with_attrs. */
static kiln_status record(kiln_trace *tr, const kiln__op_event *e, const char *name, int n_in, const int64_t *in_ids,
                          int n_out, const int64_t *out_ids, bool with_attrs) {
  if (tr->n == tr->cap) {
    int ncap = tr->cap ? tr->cap * 2 : 32;
    kiln_trace_op *nv = realloc(tr->ops, (size_t)ncap * sizeof *nv);
    if (!nv) return kiln_set_error(KILN_ERR_OOM, "kiln_trace: out of host memory");
    tr->ops = nv;
    tr->cap = ncap;
  }
  kiln_trace_op *op = &tr->ops[tr->n];
  memset(op, 0, sizeof *op);
  kiln_attr attrs[MAX_ATTRS];
  int na = with_attrs ? kiln__attrs_describe(e->op, e->attrs, attrs, MAX_ATTRS) : 0;
  int64_t *ins = malloc(sizeof(int64_t) * (size_t)(n_in ? n_in : 1));
  int64_t *outs = malloc(sizeof(int64_t) * (size_t)(n_out ? n_out : 1));
  kiln_attr *ac = calloc((size_t)(na ? na : 1), sizeof *ac);
  op->name = dup_str(name);
  op->inputs = ins;
  op->outputs = outs;
  op->attrs = ac;
  bool ok = ins && outs && ac && op->name;
  if (ok) {
    memcpy(ins, in_ids, sizeof(int64_t) * (size_t)n_in);
    memcpy(outs, out_ids, sizeof(int64_t) * (size_t)n_out);
  }
  op->n_inputs = n_in;
  op->n_outputs = n_out;
  for (int a = 0; ok && a < na; a++) {
    ac[a] = attrs[a]; /* the name is static (the op's field table); the rest is copied */
    ac[a].ints = NULL;
    ac[a].s = NULL;
    op->n_attrs = a + 1;
    if (attrs[a].s && !(ac[a].s = dup_str(attrs[a].s))) ok = false;
    if (attrs[a].type == KILN_ATTR_INTS && attrs[a].n > 0) {
      int64_t *v = malloc(sizeof(int64_t) * (size_t)attrs[a].n);
      if (v) memcpy(v, attrs[a].ints, sizeof(int64_t) * (size_t)attrs[a].n);
      else ok = false;
      ac[a].ints = v;
    }
  }
  if (!ok) {
    free_op(op);
    return kiln_set_error(KILN_ERR_OOM, "kiln_trace: out of host memory");
  }
  tr->n++;
  return KILN_OK;
}

/* One op of the program; a fused op as the chain of standard ops it stands for (its
** attributes go with the first), linked by synthetic ids, so a trace shows the layers
** the user wrote. */
static kiln_status record_event(kiln_trace *tr, const kiln__op_event *e) {
  int64_t local_in[8], local_out[8];
  int64_t *in_ids = e->n_in <= 8 ? local_in : malloc(sizeof(int64_t) * (size_t)e->n_in);
  int64_t *out_ids = e->n_out <= 8 ? local_out : malloc(sizeof(int64_t) * (size_t)e->n_out);
  kiln_status st = in_ids && out_ids ? KILN_OK : kiln_set_error(KILN_ERR_OOM, "kiln_trace: out of host memory");
  for (int i = 0; st == KILN_OK && i < e->n_in; i++) in_ids[i] = kiln_tensor_id(e->in[i]);
  for (int i = 0; st == KILN_OK && i < e->n_out; i++) out_ids[i] = kiln_tensor_id(e->out[i]);
  const char *const *parts = e->op->expands_to;
  if (st == KILN_OK && !parts) {
    st = record(tr, e, e->op->name, e->n_in, in_ids, e->n_out, out_ids, true);
  } else if (st == KILN_OK) {
    int64_t prev = 0;
    for (int p = 0; parts[p] && st == KILN_OK; p++) {
      bool first = p == 0, last = parts[p + 1] == NULL;
      int64_t mid = last ? 0 : --tr->next_synthetic;
      st = record(tr, e, parts[p], first ? e->n_in : 1, first ? in_ids : &prev, last ? e->n_out : 1,
                  last ? out_ids : &mid, first);
      prev = mid;
    }
  }
  if (in_ids != local_in) free(in_ids);
  if (out_ids != local_out) free(out_ids);
  return st;
}

static kiln_status trace_end_op(const kiln__op_event *e, void *token, void *ctx) {
  KILN__UNUSED(token);
  KILN__UNUSED(ctx);
  if (!innermost || e->depth != 0 || e->backward || e->status != KILN_OK) return KILN_OK;
  for (kiln_trace *tr = innermost; tr; tr = tr->outer) {
    kiln_status st = record_event(tr, e);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

static const kiln__observer trace_observer = {"trace", NULL, trace_end_op, NULL, NULL, NULL};

kiln_trace *kiln_trace_begin(void) {
  kiln_trace *tr = calloc(1, sizeof *tr);
  if (!tr) {
    kiln_set_error(KILN_ERR_OOM, "kiln_trace_begin: out of host memory");
    return NULL;
  }
  /* the observer is on while any thread records */
  if (atomic_fetch_add(&recording_threads, 1) == 0 && kiln__observer_add(&trace_observer) != KILN_OK) {
    atomic_fetch_sub(&recording_threads, 1);
    free(tr);
    return NULL;
  }
  tr->recording = true;
  tr->outer = innermost;
  innermost = tr;
  return tr;
}

kiln_status kiln_trace_end(kiln_trace *tr) {
  if (!tr) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_trace_end: NULL trace");
  if (!tr->recording) return kiln_set_error(KILN_ERR_STATE, "kiln_trace_end: the trace is not recording");
  if (innermost != tr)
    return kiln_set_error(KILN_ERR_STATE,
                          "kiln_trace_end: a trace begun later on this thread (or one of another "
                          "thread) must end first");
  innermost = tr->outer;
  tr->outer = NULL;
  tr->recording = false;
  if (atomic_fetch_sub(&recording_threads, 1) == 1) kiln__observer_remove(&trace_observer);
  return KILN_OK;
}

int kiln_trace_count(const kiln_trace *tr) { return tr ? tr->n : 0; }

const kiln_trace_op *kiln_trace_get(const kiln_trace *tr, int i) {
  return tr && i >= 0 && i < tr->n ? &tr->ops[i] : NULL;
}

kiln_status kiln_trace_print(const kiln_trace *tr, FILE *f) {
  if (!tr || !f) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_trace_print: NULL trace or file");
  for (int i = 0; i < tr->n; i++) {
    const kiln_trace_op *op = &tr->ops[i];
    fprintf(f, "%d: %s(", i, op->name);
    for (int k = 0; k < op->n_inputs; k++) fprintf(f, k ? ", %%%lld" : "%%%lld", (long long)op->inputs[k]);
    fprintf(f, ") ->");
    for (int k = 0; k < op->n_outputs; k++) fprintf(f, " %%%lld", (long long)op->outputs[k]);
    for (int a = 0; a < op->n_attrs; a++) {
      const kiln_attr *at = &op->attrs[a];
      fprintf(f, a ? ", %s=" : "  {%s=", at->name);
      switch (at->type) {
      case KILN_ATTR_INT: fprintf(f, "%lld", (long long)at->i); break;
      case KILN_ATTR_BOOL: fprintf(f, "%s", at->i ? "true" : "false"); break;
      case KILN_ATTR_FLOAT: fprintf(f, "%g", at->f); break;
      case KILN_ATTR_INTS:
        fprintf(f, "[");
        for (int k = 0; k < at->n; k++) fprintf(f, k ? ", %lld" : "%lld", (long long)at->ints[k]);
        fprintf(f, "]");
        break;
      case KILN_ATTR_DTYPE:
      case KILN_ATTR_STRING: fprintf(f, "%s", at->s ? at->s : "?"); break;
      }
      if (a == op->n_attrs - 1) fprintf(f, "}");
    }
    fprintf(f, "\n");
  }
  return KILN_OK;
}

void kiln_trace_free(kiln_trace *tr) {
  if (!tr) return;
  if (tr->recording) {
    /* unlink it wherever it is in this thread's chain */
    for (kiln_trace **p = &innermost; *p; p = &(*p)->outer)
      if (*p == tr) {
        *p = tr->outer;
        break;
      }
    if (atomic_fetch_sub(&recording_threads, 1) == 1) kiln__observer_remove(&trace_observer);
  }
  for (int i = 0; i < tr->n; i++) free_op(&tr->ops[i]);
  free(tr->ops);
  free(tr);
}
