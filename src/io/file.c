/*
** Atomic file writes: write a temporary file beside the target, fsync it, rename it over
** the target, fsync the directory. A crash leaves either the old file or the new one,
** never a torn one (checkpoints depend on this).
*/
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io_int.h"
#include "kiln_io.h"

static char *dup_str(const char *s) {
  size_t n = strlen(s) + 1;
  char *p = malloc(n);
  if (p) memcpy(p, s, n);
  return p;
}

/* Removes path.tmp.<pid> files left by writers that were killed mid-save (issue 17.7): a
** pid that no longer exists (kill(pid, 0) fails with ESRCH) cannot be writing. Files of
** live processes, including a concurrent save of the same path, are left alone; a pid
** reused by an unrelated process only keeps its file a while longer. Best effort:
** nothing here can fail the save. */
static void remove_stale_tmps(const char *path) {
  char *dir = dup_str(path);
  if (!dir) return;
  char *slash = strrchr(dir, '/');
  const char *base = slash ? slash + 1 : path, *d = ".";
  if (slash == dir) d = "/";
  else if (slash) {
    *slash = 0;
    d = dir;
  }
  size_t blen = strlen(base);
  DIR *dh = opendir(d);
  if (dh) {
    struct dirent *e;
    while ((e = readdir(dh))) {
      const char *n = e->d_name;
      if (strncmp(n, base, blen) || strncmp(n + blen, ".tmp.", 5)) continue;
      const char *digits = n + blen + 5;
      char *end = NULL;
      errno = 0;
      long pid = strtol(digits, &end, 10);
      if (errno || end == digits || *end || *digits < '1' || *digits > '9' || pid <= 0 ||
          pid == (long)getpid())
        continue;
      if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue; /* alive, or not ours to ask */
      size_t need = strlen(d) + strlen(n) + 2;
      char *full = malloc(need);
      if (!full) break;
      snprintf(full, need, "%s/%s", d, n);
      (void)unlink(full);
      free(full);
    }
    closedir(dh);
  }
  free(dir);
}

kiln_status kiln__atomic_open(kiln__atomic_file *af, const char *who, const char *path) {
  memset(af, 0, sizeof *af);
  af->who = who;
  if (!path || !*path) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: empty path", who);
  af->path = dup_str(path);
  size_t n = strlen(path) + 48;
  af->tmp = malloc(n);
  if (!af->path || !af->tmp) {
    free(af->path);
    free(af->tmp);
    af->path = af->tmp = NULL;
    return kiln_set_error(KILN_ERR_OOM, "%s: out of memory", who);
  }
  snprintf(af->tmp, n, "%s.tmp.%ld", path, (long)getpid());
  remove_stale_tmps(path);
  af->f = fopen(af->tmp, "wb");
  if (!af->f) {
    int e = errno;
    kiln_set_error(KILN_ERR_IO, "%s: cannot create %s: %s", who, af->tmp, strerror(e));
    free(af->path);
    free(af->tmp);
    af->path = af->tmp = NULL;
    return KILN_ERR_IO;
  }
  return KILN_OK;
}

kiln_status kiln__atomic_write(kiln__atomic_file *af, const void *data, size_t n) {
  if (!af->f || af->failed) return KILN_ERR_IO;
  if (n && fwrite(data, 1, n, af->f) != n) {
    int e = errno;
    af->failed = 1;
    return kiln_set_error(KILN_ERR_IO, "%s: write to %s failed: %s", af->who, af->tmp,
                          strerror(e));
  }
  return KILN_OK;
}

void kiln__atomic_abort(kiln__atomic_file *af) {
  if (af->f) fclose(af->f);
  if (af->tmp) remove(af->tmp);
  free(af->tmp);
  free(af->path);
  memset(af, 0, sizeof *af);
}

/* fsync of the directory makes the rename itself durable (ext4/xfs need it). */
static void sync_dir_of(const char *path) {
  char *dir = dup_str(path);
  if (!dir) return;
  char *slash = strrchr(dir, '/');
  const char *d = ".";
  if (slash == dir) d = "/";
  else if (slash) {
    *slash = 0;
    d = dir;
  }
  int fd = open(d, O_RDONLY);
  if (fd >= 0) {
    (void)fsync(fd); /* best effort: some file systems refuse fsync on a directory */
    close(fd);
  }
  free(dir);
}

kiln_status kiln__atomic_commit(kiln__atomic_file *af) {
  if (!af->f) return KILN_ERR_IO;
  if (af->failed) {
    kiln__atomic_abort(af);
    return KILN_ERR_IO;
  }
  int e = 0;
  if (fflush(af->f) != 0 || fsync(fileno(af->f)) != 0) e = errno;
  if (fclose(af->f) != 0 && !e) e = errno;
  af->f = NULL;
  if (e) {
    kiln_set_error(KILN_ERR_IO, "%s: cannot flush %s: %s", af->who, af->tmp, strerror(e));
    kiln__atomic_abort(af);
    return KILN_ERR_IO;
  }
  if (rename(af->tmp, af->path) != 0) {
    e = errno;
    kiln_set_error(KILN_ERR_IO, "%s: cannot rename %s to %s: %s", af->who, af->tmp,
                   af->path, strerror(e));
    kiln__atomic_abort(af);
    return KILN_ERR_IO;
  }
  sync_dir_of(af->path);
  free(af->tmp);
  free(af->path);
  memset(af, 0, sizeof *af);
  return KILN_OK;
}

kiln_status kiln_file_write_atomic(const char *path, const void *data, size_t n) {
  if (!path || (!data && n))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "kiln_file_write_atomic: NULL %s", path ? "data" : "path");
  kiln__atomic_file af;
  kiln_status st = kiln__atomic_open(&af, "kiln_file_write_atomic", path);
  if (st != KILN_OK) return st;
  if (kiln__atomic_write(&af, data, n) != KILN_OK) {
    kiln__atomic_abort(&af);
    return KILN_ERR_IO;
  }
  return kiln__atomic_commit(&af);
}

static const char *file_kind(mode_t m) {
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

int kiln__open_regular(const char *who, const char *path) {
  if (!path || !*path) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: empty path", who);
    return -1;
  }
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    int e = errno;
    kiln_set_error(KILN_ERR_IO, "%s: cannot open %s: %s", who, path, strerror(e));
    return -1;
  }
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    int e = errno;
    close(fd);
    kiln_set_error(KILN_ERR_IO, "%s: cannot stat %s: %s", who, path, strerror(e));
    return -1;
  }
  if (!S_ISREG(sb.st_mode)) {
    close(fd);
    kiln_set_error(KILN_ERR_IO, "%s: %s is not a regular file (%s)", who, path,
                   file_kind(sb.st_mode));
    return -1;
  }
  int fl = fcntl(fd, F_GETFL);
  if (fl != -1) (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  return fd;
}

FILE *kiln__fopen_regular(const char *who, const char *path) {
  int fd = kiln__open_regular(who, path);
  if (fd < 0) return NULL;
  FILE *f = fdopen(fd, "rb");
  if (!f) {
    int e = errno;
    close(fd);
    kiln_set_error(KILN_ERR_IO, "%s: cannot open %s: %s", who, path, strerror(e));
  }
  return f;
}

FILE *kiln__fopen_regular_size(const char *who, const char *path, uint64_t *size) {
  if (!path) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL path", who);
    return NULL;
  }
  FILE *f = kiln__fopen_regular(who, path);
  struct stat sb;
  if (f && fstat(fileno(f), &sb) != 0) {
    int e = errno;
    fclose(f);
    kiln_set_error(KILN_ERR_IO, "%s: cannot stat %s: %s", who, path, strerror(e));
    return NULL;
  }
  if (f) *size = (uint64_t)sb.st_size;
  return f;
}

char *kiln__read_regular(const char *who, const char *path, size_t *n) {
  uint64_t size = 0;
  FILE *f = kiln__fopen_regular_size(who, path, &size); /* a NULL path is refused there */
  if (!f) return NULL;
  char *buf = size < SIZE_MAX ? malloc((size_t)size + 1) : NULL;
  if (!buf) {
    fclose(f);
    kiln_set_error(KILN_ERR_OOM, "%s: out of host memory reading %s (%llu bytes)", who, path,
                   (unsigned long long)size);
    return NULL;
  }
  size_t len = size ? fread(buf, 1, (size_t)size, f) : 0; /* a file cut short since fstat: what is there */
  int err = ferror(f);
  fclose(f);
  if (err) {
    free(buf);
    kiln_set_error(KILN_ERR_IO, "%s: cannot read %s", who, path);
    return NULL;
  }
  buf[len] = 0;
  *n = len;
  return buf;
}

int kiln__host_is_le(void) {
  const uint16_t one = 1;
  unsigned char b;
  memcpy(&b, &one, 1);
  return b == 1;
}

void kiln__swap_bytes(void *data, size_t n, size_t esize) {
  if (esize <= 1) return;
  unsigned char *p = data;
  for (size_t i = 0; i < n; i++, p += esize)
    for (size_t a = 0, b = esize - 1; a < b; a++, b--) {
      unsigned char t = p[a];
      p[a] = p[b];
      p[b] = t;
    }
}

kiln_tensor *kiln__own(kiln_tensor *t) { return t ? kiln_keep(t) : NULL; }
