/*
 * Planned failures by entry-point name, shared by the fake CUDA driver and the fake GDRCopy.
 * A test asks for the next n calls of an entry point to fail (-1: every call); a process can
 * be started with a comma-separated list in an environment variable (every call fails).
 * Callers hold their own lock around every function here.
 */
#ifndef XFER_FAKE_FAULTS_H
#define XFER_FAKE_FAULTS_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FAKE_MAX_FAULTS 32

struct fake_faults {
    const char *environment; /* the variable naming entry points that always fail */
    int read_environment;
    struct {
        char name[64];
        int remaining; /* -1: every call; 0: none */
    } slot[FAKE_MAX_FAULTS];
};

/* Plans `times` failures of `name`; 0 on success, -1 when the table is full. */
static int fake_faults_plan(struct fake_faults *f, const char *name, int times) {
    int at = -1;
    for (int i = 0; i < FAKE_MAX_FAULTS; i++) {
        if (strcmp(f->slot[i].name, name) == 0) { at = i; break; }
        if (at < 0 && f->slot[i].name[0] == 0) at = i;
    }
    if (at < 0) return -1;
    snprintf(f->slot[at].name, sizeof f->slot[at].name, "%s", name);
    f->slot[at].remaining = times;
    return 0;
}

/* Whether this call of `name` is to fail (consumes one planned failure). */
static int fake_faults_take(struct fake_faults *f, const char *name) {
    if (!f->read_environment) {
        f->read_environment = 1;
        const char *list = getenv(f->environment);
        char copy[512];
        snprintf(copy, sizeof copy, "%s", list ? list : "");
        char *save = NULL;
        for (char *n = strtok_r(copy, ",", &save); n; n = strtok_r(NULL, ",", &save))
            fake_faults_plan(f, n, -1);
    }
    for (int i = 0; i < FAKE_MAX_FAULTS; i++) {
        if (f->slot[i].name[0] && strcmp(f->slot[i].name, name) == 0 && f->slot[i].remaining != 0) {
            if (f->slot[i].remaining > 0) f->slot[i].remaining--;
            return 1;
        }
    }
    return 0;
}

/* Defines the library's table (failures of every call named in `env`), its exported
 * `fail_fn(name, times)` for tests, and `failing(name)` for its entry points, under `lock`. */
#define FAKE_FAULTS_DEFINE(fail_fn, env, lock)                              \
    static struct fake_faults faults = {.environment = env};              \
    int fail_fn(const char *name, int times) {                            \
        pthread_mutex_lock(&lock);                                        \
        int r = fake_faults_plan(&faults, name, times);                   \
        pthread_mutex_unlock(&lock);                                      \
        return r;                                                         \
    }                                                                     \
    /* Whether this call of `name` is to fail. Called with `lock` held. */ \
    static int failing(const char *name) { return fake_faults_take(&faults, name); }

#endif
