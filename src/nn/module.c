/* kiln_module: named parameters, buffers and children; train/eval; moves; state dicts.
**
** A module is a tree node. Parameters and buffers are (name, tensor) entries holding one
** plain reference each; children are owned. Flattened views of the tree (dotted names and
** tensors, as returned by kiln_module_named_parameters) are cached per module and dropped
** whenever the subtree or an ancestor chain changes, so the per-step lookups a module
** optimizer makes cost a copy of pointers, not a walk with string building. */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "nn/nn_int.h"

typedef struct entry {
  char *name;
  kiln_tensor *t;
  bool persistent; /* buffers only */
} entry;

typedef struct child {
  char *name;
  kiln_module *m;
} child;

/* A flattened list: names are owned strings, tensors borrowed from the entries. */
typedef struct flat {
  bool valid;
  int n, cap;
  char **names;
  kiln_tensor **ts;
} flat;

struct kiln_module {
  const kiln_module_vtable *vt;
  void *impl;
  kiln_module *parent;
  bool training;
  bool checkpoint; /* forward goes through kiln_checkpoint (kiln_module_set_checkpoint) */
  kiln_checkpoint_keep checkpoint_keep; /* what its segment keeps (kiln_module_set_checkpoint_keep) */
  entry *params;
  int nparams, cap_params;
  entry *buffers;
  int nbuffers, cap_buffers;
  child *children;
  int nchildren, cap_children;
  flat fparams;  /* unique parameters (named_parameters) */
  flat fbuffers; /* all buffers (named_buffers) */
  /* The label the module scope shows ("layers.0 (Linear)"; the root: its type name),
  ** interned, and the tree generation it was made in (a new child anywhere renews it). */
  const char *label;
  int label_gen;
};

/* Bumped whenever a module gains a parent: labels computed before are stale. */
static atomic_int tree_gen = 1;

static char *dupstr(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = malloc(n);
  if (d) memcpy(d, s, n);
  return d;
}

static void flat_clear(flat *f) {
  for (int i = 0; i < f->n; i++) free(f->names[i]);
  f->n = 0;
  f->valid = false;
}

static void flat_free(flat *f) {
  flat_clear(f);
  free(f->names);
  free(f->ts);
  f->names = NULL;
  f->ts = NULL;
  f->cap = 0;
}

/* Every cache that can see this module's tensors: its own and its ancestors'. The
** subtree's caches see only tensors below, so a change here leaves them valid. */
static void invalidate_up(kiln_module *m) {
  for (; m; m = m->parent) {
    flat_clear(&m->fparams);
    flat_clear(&m->fbuffers);
  }
}

static void invalidate_down(kiln_module *m) {
  flat_clear(&m->fparams);
  flat_clear(&m->fbuffers);
  for (int i = 0; i < m->nchildren; i++) invalidate_down(m->children[i].m);
}

kiln_module *kiln_module_new(const kiln_module_vtable *vt, void *impl) {
  if (!vt || !vt->type_name || (!vt->forward && !vt->forward_n)) {
    if (vt && vt->free_impl && impl) vt->free_impl(impl);
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                   "kiln_module_new: the vtable needs a type_name and forward or forward_n");
    return NULL;
  }
  kiln_module *m = calloc(1, sizeof *m);
  if (!m) {
    if (vt->free_impl && impl) vt->free_impl(impl);
    kiln_set_error(KILN_ERR_OOM, "kiln_module_new: out of host memory");
    return NULL;
  }
  m->vt = vt;
  m->impl = impl;
  m->training = true;
  return m;
}

void kiln_module_free(kiln_module *m) {
  if (!m) return;
  for (int i = 0; i < m->nchildren; i++) {
    m->children[i].m->parent = NULL;
    kiln_module_free(m->children[i].m);
    free(m->children[i].name);
  }
  for (int i = 0; i < m->nparams; i++) {
    kiln_tensor_free(m->params[i].t);
    free(m->params[i].name);
  }
  for (int i = 0; i < m->nbuffers; i++) {
    kiln_tensor_free(m->buffers[i].t);
    free(m->buffers[i].name);
  }
  free(m->children);
  free(m->params);
  free(m->buffers);
  flat_free(&m->fparams);
  flat_free(&m->fbuffers);
  if (m->vt->free_impl && m->impl) m->vt->free_impl(m->impl);
  free(m);
}

void *kiln_module_impl(const kiln_module *m) { return m ? m->impl : NULL; }
const kiln_module_vtable *kiln__module_vtable(const kiln_module *m) { return m ? m->vt : NULL; }

const char *kiln_module_type_name(const kiln_module *m) { return m ? m->vt->type_name : "(null)"; }

int kiln__module_extra_repr(const kiln_module *m, char *buf, size_t n) {
  if (n) buf[0] = '\0';
  if (!m || !m->vt->extra_repr) return 0;
  return m->vt->extra_repr(m, buf, n);
}

/* ---- registration ---------------------------------------------------------------- */

static bool name_taken(const kiln_module *m, const char *name) {
  for (int i = 0; i < m->nparams; i++)
    if (!strcmp(m->params[i].name, name)) return true;
  for (int i = 0; i < m->nbuffers; i++)
    if (!strcmp(m->buffers[i].name, name)) return true;
  for (int i = 0; i < m->nchildren; i++)
    if (!strcmp(m->children[i].name, name)) return true;
  return false;
}

static kiln_status check_name(const kiln_module *m, const char *name, const char *who) {
  if (!name || !name[0])
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: empty or NULL name", who);
  if (strchr(name, '.'))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "%s: name \"%s\" contains '.', which separates nested names", who, name);
  if (name_taken(m, name))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "%s: \"%s\" is already a parameter, buffer or child of this %s", who,
                          name, m->vt->type_name);
  return KILN_OK;
}

/* The error to return when a NULL tensor/module arrives: the failure that made it NULL
** is already the last error; keep it. */
static kiln_status pending_error(const char *who) {
  kiln_status e = kiln_last_error();
  if (e != KILN_OK) return e;
  return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL argument", who);
}

static kiln_status push_entry(entry **arr, int *n, int *cap, const char *name, kiln_tensor *t,
                              bool persistent) {
  if (*n == *cap) {
    int nc = *cap ? *cap * 2 : 4;
    entry *na = realloc(*arr, (size_t)nc * sizeof *na);
    if (!na) return KILN_ERR_OOM;
    *arr = na;
    *cap = nc;
  }
  char *nm = dupstr(name);
  if (!nm) return KILN_ERR_OOM;
  (*arr)[*n] = (entry){nm, t, persistent};
  (*n)++;
  return KILN_OK;
}

kiln_status kiln_module_register_parameter(kiln_module *m, const char *name, kiln_tensor *t,
                                            bool requires_grad) {
  static const char who[] = "kiln_module_register_parameter";
  if (!t) return pending_error(who);
  t = kiln_keep(t); /* from here on this reference is ours */
  kiln_status st;
  if (!m) {
    st = kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL module", who);
  } else if ((st = check_name(m, name, who)) != KILN_OK) {
  } else if (!kiln_dtype_is_float(kiln_dtype_of(t))) {
    st = kiln_set_error(KILN_ERR_DTYPE, "%s: parameter \"%s\" has dtype %s; parameters are floating",
                        who, name, kiln_dtype_name(kiln_dtype_of(t)));
  } else if (!kiln_is_leaf(t)) {
    st = kiln_set_error(KILN_ERR_AUTOGRAD,
                        "%s: parameter \"%s\" is the result of an op (%s), not a leaf; detach it",
                        who, name, kiln_grad_fn_name(t) ? kiln_grad_fn_name(t) : "?");
  } else if ((st = kiln_requires_grad_(t, requires_grad)) != KILN_OK) {
  } else if (push_entry(&m->params, &m->nparams, &m->cap_params, name, t, true) != KILN_OK) {
    st = kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  } else {
    invalidate_up(m);
    return KILN_OK;
  }
  kiln_tensor_free(t);
  return st;
}

kiln_status kiln_module_register_buffer(kiln_module *m, const char *name, kiln_tensor *t,
                                         bool persistent) {
  static const char who[] = "kiln_module_register_buffer";
  if (!t) return pending_error(who);
  t = kiln_keep(t);
  kiln_status st;
  if (!m) {
    st = kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL module", who);
  } else if ((st = check_name(m, name, who)) != KILN_OK) {
  } else if (push_entry(&m->buffers, &m->nbuffers, &m->cap_buffers, name, t, persistent) !=
             KILN_OK) {
    st = kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  } else {
    invalidate_up(m);
    return KILN_OK;
  }
  kiln_tensor_free(t);
  return st;
}

kiln_status kiln_module_add_child(kiln_module *m, const char *name, kiln_module *c) {
  static const char who[] = "kiln_module_add_child";
  if (!c) return pending_error(who);
  kiln_status st;
  if (!m) {
    st = kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL module", who);
  } else if (c->parent || c == m) {
    st = kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: \"%s\" (%s) already has a parent", who,
                        name ? name : "(null)", c->vt->type_name);
    return st; /* not ours to free: it belongs to its parent */
  } else if ((st = check_name(m, name, who)) != KILN_OK) {
  } else {
    if (m->nchildren == m->cap_children) {
      int nc = m->cap_children ? m->cap_children * 2 : 4;
      child *na = realloc(m->children, (size_t)nc * sizeof *na);
      if (!na) goto oom;
      m->children = na;
      m->cap_children = nc;
    }
    char *nm = dupstr(name);
    if (!nm) goto oom;
    m->children[m->nchildren++] = (child){nm, c};
    c->parent = m;
    atomic_fetch_add(&tree_gen, 1);
    invalidate_up(m);
    return KILN_OK;
  oom:
    st = kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  }
  kiln_module_free(c);
  return st;
}

/* ---- lookup ------------------------------------------------------------------------ */

/* Walks the dotted prefix of name down the children; *leaf gets the last component. */
static const kiln_module *walk(const kiln_module *m, const char *name, const char **leaf) {
  while (m) {
    const char *dot = strchr(name, '.');
    if (!dot) {
      *leaf = name;
      return m;
    }
    size_t len = (size_t)(dot - name);
    const kiln_module *next = NULL;
    for (int i = 0; i < m->nchildren; i++)
      if (strlen(m->children[i].name) == len && !strncmp(m->children[i].name, name, len)) {
        next = m->children[i].m;
        break;
      }
    m = next;
    name = dot + 1;
  }
  return NULL;
}

static entry *find_entry(entry *arr, int n, const char *name) {
  for (int i = 0; i < n; i++)
    if (!strcmp(arr[i].name, name)) return &arr[i];
  return NULL;
}

/* The parameter (or with buffer, the buffer) a dotted name gives; NULL when none. A name
** without a dot (a forward looking up its own "weight") is m's own: walk returns at once. */
static kiln_tensor *lookup(const kiln_module *m, const char *name, bool buffer) {
  if (!m || !name) return NULL;
  const char *leaf;
  const kiln_module *o = walk(m, name, &leaf);
  if (!o) return NULL;
  entry *e = buffer ? find_entry(o->buffers, o->nbuffers, leaf) : find_entry(o->params, o->nparams, leaf);
  return e ? e->t : NULL;
}

kiln_tensor *kiln_module_param(const kiln_module *m, const char *name) { return lookup(m, name, false); }

kiln_tensor *kiln_module_buffer(const kiln_module *m, const char *name) { return lookup(m, name, true); }

kiln_module *kiln_module_child(const kiln_module *m, const char *name) {
  if (!m || !name) return NULL;
  const char *leaf;
  const kiln_module *o = walk(m, name, &leaf);
  if (!o) return NULL;
  for (int i = 0; i < o->nchildren; i++)
    if (!strcmp(o->children[i].name, leaf)) return o->children[i].m;
  return NULL;
}

kiln_status kiln_module_set_buffer(kiln_module *m, const char *name, kiln_tensor *t) {
  static const char who[] = "kiln_module_set_buffer";
  if (!t) return pending_error(who);
  t = kiln_keep(t);
  const char *leaf = NULL;
  kiln_module *o = m && name ? (kiln_module *)walk(m, name, &leaf) : NULL;
  entry *e = o ? find_entry(o->buffers, o->nbuffers, leaf) : NULL;
  if (!e) {
    kiln_tensor_free(t);
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: no buffer \"%s\"", who,
                          name ? name : "(null)");
  }
  kiln_tensor_free(e->t);
  e->t = t;
  invalidate_up(o);
  return KILN_OK;
}

int kiln_module_num_children(const kiln_module *m) { return m ? m->nchildren : 0; }

kiln_module *kiln_module_child_at(const kiln_module *m, int i) {
  return m && i >= 0 && i < m->nchildren ? m->children[i].m : NULL;
}

const char *kiln_module_child_name(const kiln_module *m, int i) {
  return m && i >= 0 && i < m->nchildren ? m->children[i].name : NULL;
}

/* ---- forward, mode --------------------------------------------------------------------- */

/* The module's own forward, as kiln_checkpoint calls it (ctx is the module). */
static kiln_status checkpointed_forward(void *ctx, int n_in, kiln_tensor *const *xs, int n_out, kiln_tensor **out) {
  kiln_module *m = ctx;
  (void)n_out;
  if (n_in == 1 && m->vt->forward) out[0] = m->vt->forward(m, xs[0]);
  else out[0] = m->vt->forward_n(m, n_in, xs);
  return out[0] ? KILN_OK : kiln_last_error();
}

static kiln_tensor *forward_checkpointed(kiln_module *m, int n, kiln_tensor *const *xs) {
  kiln_tensor *y = NULL;
  const kiln_checkpoint_options o = {0, NULL, m->checkpoint_keep};
  if (kiln_checkpoint_with(checkpointed_forward, m, &o, n, xs, 1, &y) != KILN_OK) return NULL;
  return y;
}

/* A plain Sequential's settings are its children's (one segment per block). */
static bool marks_children(const kiln_module *m) {
  return strcmp(m->vt->type_name, "Sequential") == 0 && !m->impl && m->nchildren > 0;
}

kiln_status kiln_module_set_checkpoint(kiln_module *m, bool on) {
  if (!m) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_module_set_checkpoint: NULL module");
  if (marks_children(m)) {
    for (int i = 0; i < m->nchildren; i++) m->children[i].m->checkpoint = on;
  } else {
    m->checkpoint = on;
  }
  return KILN_OK;
}

bool kiln_module_is_checkpointed(const kiln_module *m) { return m && m->checkpoint; }

kiln_status kiln_module_set_checkpoint_keep(kiln_module *m, kiln_checkpoint_keep keep) {
  static const char who[] = "kiln_module_set_checkpoint_keep";
  if (!m) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL module", who);
  if (keep != KILN_CHECKPOINT_KEEP_DEFAULT && keep != KILN_CHECKPOINT_KEEP_PRODUCTS)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: unknown keep policy %d", who, (int)keep);
  if (marks_children(m)) {
    for (int i = 0; i < m->nchildren; i++) m->children[i].m->checkpoint_keep = keep;
  } else {
    m->checkpoint_keep = keep;
  }
  return KILN_OK;
}

kiln_checkpoint_keep kiln_module_checkpoint_keep(const kiln_module *m) {
  return m ? m->checkpoint_keep : KILN_CHECKPOINT_KEEP_DEFAULT;
}

/* The dotted path from the root ("layers.0"): the child names up the parent chain. */
static void path_of(const kiln_module *m, char *buf, size_t n) {
  if (!m->parent) {
    buf[0] = 0;
    return;
  }
  path_of(m->parent, buf, n);
  const kiln_module *p = m->parent;
  for (int i = 0; i < p->nchildren; i++)
    if (p->children[i].m == m) {
      size_t k = strlen(buf);
      snprintf(buf + k, n - k, "%s%s", k ? "." : "", p->children[i].name);
      return;
    }
}

/* The module's label for the module scope, made once per tree generation. */
const char *kiln__module_label(kiln_module *m) {
  int gen = atomic_load_explicit(&tree_gen, memory_order_relaxed);
  if (m->label && m->label_gen == gen) return m->label;
  char path[512], label[640];
  path_of(m, path, sizeof path);
  if (path[0]) snprintf(label, sizeof label, "%s (%s)", path, m->vt->type_name);
  else snprintf(label, sizeof label, "%s", m->vt->type_name);
  m->label = kiln__intern(label);
  m->label_gen = gen;
  return m->label;
}

static _Thread_local kiln__act_measure *measuring;

void kiln__module_measure_set(kiln__act_measure *a) { measuring = a; }
bool kiln__module_measuring(void) { return measuring != NULL; }

void kiln__module_measure_note(kiln_module *m, int64_t bytes) {
  kiln__act_measure *a = measuring;
  if (!a) return;
  for (int i = 0; i < a->n; i++)
    if (a->mods[i] == m) {
      a->bytes[i] += bytes;
      return;
    }
  if (a->n == a->cap) {
    int nc = a->cap ? 2 * a->cap : 16;
    kiln_module **nm = realloc(a->mods, (size_t)nc * sizeof *nm);
    if (!nm) return;
    a->mods = nm;
    int64_t *nb = realloc(a->bytes, (size_t)nc * sizeof *nb);
    if (!nb) return;
    a->bytes = nb;
    a->cap = nc;
  }
  a->mods[a->n] = m;
  a->bytes[a->n++] = bytes;
}

static int64_t saved_now(void) {
  int64_t live = 0;
  if (measuring) kiln_autograd_saved_bytes(&live, NULL);
  return live;
}

kiln_tensor *kiln_module_forward(kiln_module *m, kiln_tensor *x) {
  if (!m) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_module_forward: NULL module");
    return NULL;
  }
  if (!x) return NULL;
  kiln__module_scope_push(kiln__module_label(m));
  int64_t s0 = saved_now();
  kiln_tensor *y = m->checkpoint && kiln_grad_enabled() ? forward_checkpointed(m, 1, &x)
                   : m->vt->forward                     ? m->vt->forward(m, x)
                                                        : m->vt->forward_n(m, 1, &x);
  if (measuring) kiln__module_measure_note(m, saved_now() - s0);
  kiln__module_scope_pop();
  return y;
}

kiln_tensor *kiln_module_forward_n(kiln_module *m, int n, kiln_tensor *const *xs) {
  if (!m || n < 0 || (n > 0 && !xs)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_module_forward_n: NULL module or inputs");
    return NULL;
  }
  for (int i = 0; i < n; i++)
    if (!xs[i]) return NULL;
  if (!m->vt->forward_n && n != 1) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_module_forward_n: %s takes one input, got %d",
                   m->vt->type_name, n);
    return NULL;
  }
  kiln__module_scope_push(kiln__module_label(m));
  int64_t s0 = saved_now();
  kiln_tensor *y = m->checkpoint && kiln_grad_enabled() ? forward_checkpointed(m, n, xs)
                   : m->vt->forward_n                   ? m->vt->forward_n(m, n, xs)
                                                        : m->vt->forward(m, xs[0]);
  if (measuring) kiln__module_measure_note(m, saved_now() - s0);
  kiln__module_scope_pop();
  return y;
}

void kiln_module_train(kiln_module *m, bool on) {
  if (!m) return;
  m->training = on;
  for (int i = 0; i < m->nchildren; i++) kiln_module_train(m->children[i].m, on);
}

void kiln_module_eval(kiln_module *m) { kiln_module_train(m, false); }

bool kiln_module_is_training(const kiln_module *m) { return m ? m->training : false; }

/* ---- walking ------------------------------------------------------------------------- */

/* Calls fn for each entry (params or buffers) of the subtree with its dotted name. */
typedef bool (*entry_fn)(void *ctx, const char *name, entry *e);

static bool walk_entries(kiln_module *m, const char *prefix, bool buffers, entry_fn fn, void *ctx) {
  char name[1024];
  int n = buffers ? m->nbuffers : m->nparams;
  entry *arr = buffers ? m->buffers : m->params;
  for (int i = 0; i < n; i++) {
    snprintf(name, sizeof name, "%s%s%s", prefix, prefix[0] ? "." : "", arr[i].name);
    if (!fn(ctx, name, &arr[i])) return false;
  }
  for (int i = 0; i < m->nchildren; i++) {
    snprintf(name, sizeof name, "%s%s%s", prefix, prefix[0] ? "." : "", m->children[i].name);
    if (!walk_entries(m->children[i].m, name, buffers, fn, ctx)) return false;
  }
  return true;
}

typedef struct flat_ctx {
  flat *f;
  bool dedup;
  bool oom;
} flat_ctx;

static bool flat_add(void *vctx, const char *name, entry *e) {
  flat_ctx *c = vctx;
  flat *f = c->f;
  if (c->dedup)
    for (int i = 0; i < f->n; i++)
      if (f->ts[i] == e->t) return true;
  if (f->n == f->cap) {
    int nc = f->cap ? f->cap * 2 : 16;
    char **nn = realloc(f->names, (size_t)nc * sizeof *nn);
    if (!nn) goto oom;
    f->names = nn;
    kiln_tensor **nt = realloc(f->ts, (size_t)nc * sizeof *nt);
    if (!nt) goto oom;
    f->ts = nt;
    f->cap = nc;
  }
  char *d = dupstr(name);
  if (!d) goto oom;
  f->names[f->n] = d;
  f->ts[f->n] = e->t;
  f->n++;
  return true;
oom:
  c->oom = true;
  return false;
}

static flat *get_flat(kiln_module *m, bool buffers) {
  flat *f = buffers ? &m->fbuffers : &m->fparams;
  if (f->valid) return f;
  flat_clear(f);
  flat_ctx c = {f, !buffers, false};
  walk_entries(m, "", buffers, flat_add, &c);
  if (c.oom) {
    flat_clear(f);
    kiln_set_error(KILN_ERR_OOM, "kiln_module_parameters: out of host memory");
    return NULL;
  }
  f->valid = true;
  return f;
}

static int named(kiln_module *m, bool buffers, const char **names, kiln_tensor **out, int max) {
  if (!m) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_module_parameters: NULL module");
    return -1;
  }
  flat *f = get_flat(m, buffers);
  if (!f) return -1;
  for (int i = 0; i < f->n && i < max; i++) {
    if (out) out[i] = f->ts[i];
    if (names) names[i] = f->names[i];
  }
  return f->n;
}

int kiln_module_parameters(kiln_module *m, kiln_tensor **out, int max) {
  return named(m, false, NULL, out, max);
}

int kiln_module_named_parameters(kiln_module *m, const char **names, kiln_tensor **out, int max) {
  return named(m, false, names, out, max);
}

int kiln_module_named_buffers(kiln_module *m, const char **names, kiln_tensor **out, int max) {
  return named(m, true, names, out, max);
}

static int64_t sum_over(kiln_module *m, bool buffers, int what) {
  if (!m) return 0;
  flat *f = get_flat(m, buffers);
  if (!f) return -1;
  int64_t s = 0;
  for (int i = 0; i < f->n; i++) {
    kiln_tensor *t = f->ts[i];
    switch (what) {
    case 0: s += kiln_numel(t); break;
    case 1: s += kiln_requires_grad(t) ? kiln_numel(t) : 0; break;
    case 2: s += (int64_t)kiln_nbytes(t); break;
    default: s += kiln_grad(t) ? (int64_t)kiln_nbytes(kiln_grad(t)) : 0; break;
    }
  }
  return s;
}

int64_t kiln_module_num_params(kiln_module *m) { return sum_over(m, false, 0); }
int64_t kiln_module_num_trainable_params(kiln_module *m) { return sum_over(m, false, 1); }
int64_t kiln_module_param_bytes(kiln_module *m) { return sum_over(m, false, 2); }
int64_t kiln_module_grad_bytes(kiln_module *m) { return sum_over(m, false, 3); }
int64_t kiln_module_buffer_bytes(kiln_module *m) { return sum_over(m, true, 2); }

/* ---- moves ------------------------------------------------------------------------------ */

/* A move converts every distinct tensor of the subtree once (so tied weights stay tied),
** then swaps all entries at the end, so that a failure halfway changes nothing. */
typedef struct move_item {
  kiln_tensor *old_t, *new_t;
  kiln_tensor *new_grad;
  bool is_param;
} move_item;

typedef struct move_ctx {
  move_item *items;
  int n, cap;
  bool oom;
  bool is_param;
} move_ctx;

static bool move_collect(void *vctx, const char *name, entry *e) {
  (void)name;
  move_ctx *c = vctx;
  for (int i = 0; i < c->n; i++)
    if (c->items[i].old_t == e->t) return true;
  if (c->n == c->cap) {
    int nc = c->cap ? c->cap * 2 : 16;
    move_item *ni = realloc(c->items, (size_t)nc * sizeof *ni);
    if (!ni) {
      c->oom = true;
      return false;
    }
    c->items = ni;
    c->cap = nc;
  }
  c->items[c->n++] = (move_item){e->t, NULL, NULL, c->is_param};
  return true;
}

static bool move_swap(void *vctx, const char *name, entry *e) {
  (void)name;
  move_ctx *c = vctx;
  for (int i = 0; i < c->n; i++)
    if (c->items[i].old_t == e->t) {
      kiln_tensor_free(e->t);
      e->t = kiln_tensor_ref(c->items[i].new_t);
      return true;
    }
  return true;
}

typedef enum convert_kind { CONVERT_DEVICE, CONVERT_DTYPE, CONVERT_FORMAT } convert_kind;
typedef struct convert {
  convert_kind kind;
  kiln_device dev;
  kiln_dtype dt;
  kiln_memory_format format;
} convert;

/* A new reference owned by the caller (no scope): t converted, or t itself. */
static kiln_tensor *convert_one(kiln_tensor *t, const convert *cv) {
  kiln_tensor *r;
  if (cv->kind == CONVERT_DTYPE)
    r = kiln_dtype_is_float(kiln_dtype_of(t)) ? kiln_to_dtype(t, cv->dt) : kiln_tensor_ref(t);
  else if (cv->kind == CONVERT_FORMAT)
    /* 4-d floating tensors only (convolution weights), as PyTorch's Module.to(memory_format) */
    r = kiln_ndim(t) == 4 && kiln_dtype_is_float(kiln_dtype_of(t)) ? kiln_contiguous_format(t, cv->format)
                                                                    : kiln_tensor_ref(t);
  else
    r = kiln_to_device(t, cv->dev);
  return kiln_keep(r);
}

static kiln_status module_convert(kiln_module *m, const convert *cv, const char *who) {
  if (!m) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL module", who);
  if (cv->kind == CONVERT_DTYPE && !kiln_dtype_is_float(cv->dt))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: %s is not a floating dtype", who,
                          kiln_dtype_name(cv->dt));
  move_ctx c = {0};
  c.is_param = true;
  walk_entries(m, "", false, move_collect, &c);
  int nparam_items = c.n;
  c.is_param = false;
  if (!c.oom) walk_entries(m, "", true, move_collect, &c);
  if (c.oom) {
    free(c.items);
    return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  }
  (void)nparam_items;
  bool prev = kiln_set_grad_enabled(false); /* a move is not part of any graph */
  kiln_status st = KILN_OK;
  for (int i = 0; i < c.n && st == KILN_OK; i++) {
    move_item *it = &c.items[i];
    it->new_t = convert_one(it->old_t, cv);
    if (!it->new_t) {
      st = kiln_last_error() != KILN_OK ? kiln_last_error() : KILN_ERR_INTERNAL;
      break;
    }
    kiln_tensor *g = it->is_param ? kiln_grad(it->old_t) : NULL;
    if (g) {
      it->new_grad = convert_one(g, cv);
      if (!it->new_grad) st = kiln_last_error() != KILN_OK ? kiln_last_error() : KILN_ERR_INTERNAL;
    }
  }
  if (st == KILN_OK) {
    for (int i = 0; i < c.n && st == KILN_OK; i++) {
      move_item *it = &c.items[i];
      if (it->new_t == it->old_t) continue;
      if (it->is_param) {
        st = kiln_requires_grad_(it->new_t, kiln_requires_grad(it->old_t));
        if (st == KILN_OK && it->new_grad) st = kiln_set_grad(it->new_t, it->new_grad);
      }
    }
  }
  kiln_set_grad_enabled(prev);
  if (st == KILN_OK) {
    walk_entries(m, "", false, move_swap, &c);
    walk_entries(m, "", true, move_swap, &c);
    invalidate_down(m);
    invalidate_up(m);
  }
  for (int i = 0; i < c.n; i++) {
    kiln_tensor_free(c.items[i].new_t);
    kiln_tensor_free(c.items[i].new_grad);
  }
  free(c.items);
  return st;
}

kiln_status kiln_module_to(kiln_module *m, kiln_device dev) {
  convert cv = {CONVERT_DEVICE, dev, KILN_F32, KILN_CONTIGUOUS_FORMAT};
  return module_convert(m, &cv, "kiln_module_to");
}

kiln_status kiln_module_to_dtype(kiln_module *m, kiln_dtype dt) {
  convert cv = {CONVERT_DTYPE, kiln_device_cpu(), dt, KILN_CONTIGUOUS_FORMAT};
  return module_convert(m, &cv, "kiln_module_to_dtype");
}

kiln_status kiln_module_to_format(kiln_module *m, kiln_memory_format format) {
  if (format != KILN_CONTIGUOUS_FORMAT && format != KILN_CHANNELS_LAST)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_module_to_format: unknown memory format %d", (int)format);
  convert cv = {CONVERT_FORMAT, kiln_device_cpu(), KILN_F32, format};
  return module_convert(m, &cv, "kiln_module_to_format");
}

/* ---- state dicts ------------------------------------------------------------------------- */

typedef struct sd_ctx {
  kiln_dict *d;
  bool failed;
} sd_ctx;

static bool sd_add(void *vctx, const char *name, entry *e) {
  sd_ctx *c = vctx;
  if (!e->persistent) return true;
  if (kiln_dict_set(c->d, name, e->t) != KILN_OK) {
    c->failed = true;
    return false;
  }
  return true;
}

/* Every state entry (parameters, then persistent buffers, module by module like
** PyTorch: own first, children after). */
static bool walk_state(kiln_module *m, const char *prefix, entry_fn fn, void *ctx) {
  char name[1024];
  for (int i = 0; i < m->nparams; i++) {
    snprintf(name, sizeof name, "%s%s%s", prefix, prefix[0] ? "." : "", m->params[i].name);
    if (!fn(ctx, name, &m->params[i])) return false;
  }
  for (int i = 0; i < m->nbuffers; i++) {
    if (!m->buffers[i].persistent) continue;
    snprintf(name, sizeof name, "%s%s%s", prefix, prefix[0] ? "." : "", m->buffers[i].name);
    if (!fn(ctx, name, &m->buffers[i])) return false;
  }
  for (int i = 0; i < m->nchildren; i++) {
    snprintf(name, sizeof name, "%s%s%s", prefix, prefix[0] ? "." : "", m->children[i].name);
    if (!walk_state(m->children[i].m, name, fn, ctx)) return false;
  }
  return true;
}

kiln_dict *kiln_module_state_dict(kiln_module *m) {
  if (!m) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_module_state_dict: NULL module");
    return NULL;
  }
  kiln_dict *d = kiln_dict_new();
  if (!d) return NULL;
  sd_ctx c = {d, false};
  walk_state(m, "", sd_add, &c);
  if (c.failed) {
    kiln_dict_free(d);
    return NULL;
  }
  return d;
}

typedef struct load_ctx {
  const kiln_dict *d;
  bool strict, apply;
  kiln__problems p;
  kiln__sb names; /* every module key, '\n'-separated, for the unexpected-key check */
  kiln_status copy_status;
  const char *who;
} load_ctx;

static bool shapes_equal(const kiln_tensor *a, const kiln_tensor *b) {
  if (kiln_ndim(a) != kiln_ndim(b)) return false;
  for (int i = 0; i < kiln_ndim(a); i++)
    if (kiln_shape(a)[i] != kiln_shape(b)[i]) return false;
  return true;
}

static bool load_check(void *vctx, const char *name, entry *e) {
  load_ctx *c = vctx;
  kiln__sb_printf(&c->names, "%s\n", name);
  kiln_tensor *src = kiln_dict_get(c->d, name);
  if (!src) {
    if (c->strict) kiln__problems_missing(&c->p, name);
    return true;
  }
  char b1[128], b2[128];
  if (!shapes_equal(src, e->t))
    kiln__problems_mismatch(&c->p, KILN_ERR_SHAPE, "%s: shape %s in the state dict, %s in the model",
                            name, kiln_shape_str(src, b1, sizeof b1), kiln_shape_str(e->t, b2, sizeof b2));
  else if (kiln_dtype_of(src) != kiln_dtype_of(e->t))
    kiln__problems_mismatch(&c->p, KILN_ERR_DTYPE, "%s: dtype %s in the state dict, %s in the model",
                            name, kiln_dtype_name(kiln_dtype_of(src)),
                            kiln_dtype_name(kiln_dtype_of(e->t)));
  return true;
}

static bool load_copy(void *vctx, const char *name, entry *e) {
  load_ctx *c = vctx;
  kiln_tensor *src = kiln_dict_get(c->d, name);
  if (!src) return true;
  kiln_scope_begin();
  kiln_tensor *s = src;
  if (!kiln_device_equal(kiln_device_of(src), kiln_device_of(e->t)))
    s = kiln_to_device(src, kiln_device_of(e->t));
  kiln_status st = s ? kiln_copy_(e->t, s) : kiln_last_error();
  kiln_scope_end();
  if (st != KILN_OK) {
    c->copy_status = st;
    return false;
  }
  return true;
}

static bool key_listed(const char *names, const char *key) {
  size_t n = strlen(key);
  for (const char *p = names; *p;) {
    const char *nl = strchr(p, '\n');
    size_t len = nl ? (size_t)(nl - p) : strlen(p);
    if (len == n && !strncmp(p, key, n)) return true;
    if (!nl) break;
    p = nl + 1;
  }
  return false;
}

kiln_status kiln__module_load_state_dict(kiln_module *m, const kiln_dict *d, bool strict,
                                         bool apply, const char *who) {
  if (!m || !d) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL module or dict", who);
  load_ctx c = {0};
  c.d = d;
  c.strict = strict;
  c.apply = apply;
  c.who = who;
  walk_state(m, "", load_check, &c);
  if (strict)
    for (int i = 0; i < kiln_dict_size(d); i++) {
      const char *k = kiln_dict_key(d, i);
      if (!key_listed(kiln__sb_str(&c.names), k)) kiln__problems_unexpected(&c.p, k);
    }
  kiln_status st = kiln__problems_report(&c.p, who);
  if (st == KILN_OK && apply) {
    bool prev = kiln_set_grad_enabled(false);
    walk_state(m, "", load_copy, &c);
    kiln_set_grad_enabled(prev);
    st = c.copy_status;
  }
  kiln__problems_free(&c.p);
  kiln__sb_free(&c.names);
  return st;
}

kiln_status kiln_module_load_state_dict(kiln_module *m, const kiln_dict *d, bool strict) {
  return kiln__module_load_state_dict(m, d, strict, true, "kiln_module_load_state_dict");
}
