#!/usr/bin/env python3
"""TensorFlow peer: the TF CIFAR-10 tutorial net, trained the way a towers tower trains it, so
images/s can be compared side by side on the same machine in the same run.

The net of tensorflow/models tutorials/image/cifar10 (inference()), with TF's own ops: conv1
5x5 3->64 SAME + ReLU, max-pool 3x3/2 SAME, LRN(depth_radius 4, bias 1, alpha 0.001/9,
beta 0.75), conv2 5x5 64->64 SAME + ReLU, LRN, max-pool, local3 -> 384 ReLU, local4 -> 192 ReLU,
logits -> 10; the tutorial's initializers; momentum SGD (lr 0.01, momentum 0.9) on the
cross-entropy plus 0.004 x l2_loss of the local3/local4 weights. A step is forward, loss,
gradients and the update, in one tf.function, on a fixed random batch (no data loading).
NHWC: the layout TensorFlow's CPU kernels (oneDNN) run natively.

--towers N runs the step under tf.distribute.MirroredStrategy over N logical CPU devices
(one variable copy each, gradients all-reduced, every replica updating its copy): the global
batch is N x --batch, as in towers' sync mode.

Prints one JSON line: {"peer": "tensorflow", "images_per_sec": ..., ...}.
"""
import argparse
import json
import os
import platform
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128, help="examples per tower per step")
    ap.add_argument("--towers", type=int, default=1, help="MirroredStrategy replicas (logical CPUs)")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: TensorFlow's default)")
    ap.add_argument("--seconds", type=float, default=20.0, help="time to measure")
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    if args.threads > 0:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    cpus = tf.config.list_physical_devices("CPU")
    if args.towers > 1:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(args.towers)])
        strategy = tf.distribute.MirroredStrategy(
            devices=[f"/cpu:{i}" for i in range(args.towers)],
            cross_device_ops=tf.distribute.ReductionToOneDevice())
    else:
        strategy = tf.distribute.get_strategy()  # the default: no replication
    tf.random.set_seed(0)

    def tn(shape, std):
        return tf.Variable(tf.random.truncated_normal(shape, stddev=std))

    with strategy.scope():
        w = {
            "conv1": tn([5, 5, 3, 64], 5e-2), "conv2": tn([5, 5, 64, 64], 5e-2),
            "local3": tn([6 * 6 * 64, 384], 0.04), "local4": tn([384, 192], 0.04),
            "softmax_linear": tn([192, 10], 1.0 / 192.0),
        }
        b = {
            "conv1": tf.Variable(tf.zeros([64])), "conv2": tf.Variable(tf.fill([64], 0.1)),
            "local3": tf.Variable(tf.fill([384], 0.1)), "local4": tf.Variable(tf.fill([192], 0.1)),
            "softmax_linear": tf.Variable(tf.zeros([10])),
        }
        opt = tf.keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)
        variables = list(w.values()) + list(b.values())
        opt.build(variables)

    def inference(x):
        lrn = dict(depth_radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75)
        x = tf.nn.relu(tf.nn.conv2d(x, w["conv1"], 1, "SAME") + b["conv1"])
        x = tf.nn.max_pool2d(x, 3, 2, "SAME")
        x = tf.nn.local_response_normalization(x, **lrn)
        x = tf.nn.relu(tf.nn.conv2d(x, w["conv2"], 1, "SAME") + b["conv2"])
        x = tf.nn.local_response_normalization(x, **lrn)
        x = tf.nn.max_pool2d(x, 3, 2, "SAME")
        x = tf.reshape(x, [tf.shape(x)[0], -1])
        x = tf.nn.relu(x @ w["local3"] + b["local3"])
        x = tf.nn.relu(x @ w["local4"] + b["local4"])
        return x @ w["softmax_linear"] + b["softmax_linear"]

    global_batch = args.batch * args.towers
    x = tf.random.normal([global_batch, 24, 24, 3])
    y = tf.random.uniform([global_batch], 0, 10, dtype=tf.int32)
    data = strategy.experimental_distribute_values_from_function(
        lambda ctx: (x[ctx.replica_id_in_sync_group * args.batch:(ctx.replica_id_in_sync_group + 1) * args.batch],
                     y[ctx.replica_id_in_sync_group * args.batch:(ctx.replica_id_in_sync_group + 1) * args.batch]))

    def replica_step(xy):
        xs, ys = xy
        with tf.GradientTape() as tape:
            logits = inference(xs)
            xent = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=ys, logits=logits))
            decay = 0.004 * (tf.nn.l2_loss(w["local3"]) + tf.nn.l2_loss(w["local4"]))
            # The mean over the global batch, as towers' sync mode averages.
            loss = (xent + decay) / strategy.num_replicas_in_sync
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return xent

    @tf.function
    def step():
        per = strategy.run(replica_step, args=(data,))
        return strategy.reduce(tf.distribute.ReduceOp.MEAN, per, axis=None)

    for _ in range(args.warmup):
        loss = step()
    assert bool(tf.math.is_finite(loss)), "loss is not finite"
    # Five windows; the median is the figure, the best is reported too.
    rates, steps_total, t_all = [], 0, time.perf_counter()
    for _ in range(5):
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds / 5:
            loss = step()
            steps += 1
        loss.numpy()  # the last step has finished
        rates.append(steps * global_batch / (time.perf_counter() - t0))
        steps_total += steps
    rates.sort()
    print(json.dumps({
        "peer": "tensorflow", "version": tf.__version__, "mode": "tf.function",
        "towers": args.towers, "batch": args.batch,
        "threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "steps": steps_total, "seconds": time.perf_counter() - t_all,
        "images_per_sec": rates[len(rates) // 2], "images_per_sec_best": rates[-1],
        "loss": float(loss), "machine": platform.processor() or platform.machine(),
    }))


if __name__ == "__main__":
    main()
