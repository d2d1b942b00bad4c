#!/usr/bin/env python3
"""DP-SGD on CIFAR-10-shaped data, written the way Opacus' examples/cifar10.py is written.

This script is in the shape of Opacus' CIFAR-10 example on one process (its options and
defaults, a convolutional network of four 3x3 convolutions with average pooling, SGD with
momentum or RMSprop or Adam, a cosine learning-rate schedule set in ``param_groups`` at each
epoch, an epsilon line every ``--print-freq`` steps, accuracy in numpy, a checkpoint each
epoch), with the data replaced by random tensors of CIFAR-10's shape (3x32x32 images, 10
classes) so that it needs no download and no torchvision. Its only opake-specific line is the
import of ``PrivacyEngine``: with ``from opacus import PrivacyEngine`` instead it is an Opacus
script (tests/torch/opacus/test_example_scripts.py runs both forms). Multi-GPU training and the
``grad_sample_mode="no_op"`` loop of the original are left out.

Files are written to ``--checkpoint-file`` + ".tar" and, next to it, ``model_best.pth.tar``.
"""

import argparse
import os
import shutil
from datetime import datetime, timedelta

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import torch.utils.data
from opake.torch import PrivacyEngine

try:
    from tqdm import tqdm
except ImportError:  # progress bars are optional
    def tqdm(iterable, **_):
        return iterable


IMAGE_SHAPE = (3, 32, 32)
NUM_CLASSES = 10


def random_cifar10(count, seed):
    """``count`` standardized random images of CIFAR-10's shape with random labels, as a TensorDataset."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(count, *IMAGE_SHAPE, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (count,), generator=generator)
    return torch.utils.data.TensorDataset(images, labels)


def convnet(num_classes):
    """Four 3x3 convolutions (32, 64, 64, 128 channels) with ReLU; average pooling halves the image
    after each of the first three, a global average after the last; one linear layer."""
    layers = []
    channels = [3, 32, 64, 64, 128]
    for index, (inputs, outputs) in enumerate(zip(channels, channels[1:])):
        layers += [nn.Conv2d(inputs, outputs, kernel_size=3, stride=1, padding=1), nn.ReLU()]
        layers.append(nn.AvgPool2d(kernel_size=2, stride=2) if index < 3 else nn.AdaptiveAvgPool2d((1, 1)))
    return nn.Sequential(*layers, nn.Flatten(start_dim=1, end_dim=-1), nn.Linear(128, num_classes, bias=True))


def save_checkpoint(state, is_best, filename):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, os.path.join(os.path.dirname(filename), "model_best.pth.tar"))


def accuracy(preds, labels):
    return (preds == labels).mean()


def train(args, model, train_loader, optimizer, privacy_engine, epoch, device):
    start_time = datetime.now()
    model.train()
    criterion = nn.CrossEntropyLoss()
    losses, top1_acc = [], []

    for i, (images, target) in enumerate(tqdm(train_loader)):
        images, target = images.to(device), target.to(device)
        output = model(images)
        loss = criterion(output, target)
        preds = np.argmax(output.detach().cpu().numpy(), axis=1)
        labels = target.detach().cpu().numpy()
        top1_acc.append(accuracy(preds, labels))
        loss.backward()
        losses.append(loss.item())

        # a step for every batch, the last one included, so the next epoch starts clean
        optimizer.step()
        optimizer.zero_grad()

        if i % args.print_freq == 0:
            line = f"\tTrain Epoch: {epoch} \tLoss: {np.nanmean(losses):.6f} Acc@1: {np.nanmean(top1_acc):.6f} "
            if not args.disable_dp:
                epsilon = privacy_engine.accountant.get_epsilon(delta=args.delta)
                line += f"(ε = {epsilon:.2f}, δ = {args.delta})"
            print(line)
    return datetime.now() - start_time


def test(args, model, test_loader, device):
    model.eval()
    criterion = nn.CrossEntropyLoss()
    losses, top1_acc = [], []
    with torch.no_grad():
        for images, target in tqdm(test_loader):
            images, target = images.to(device), target.to(device)
            output = model(images)
            losses.append(criterion(output, target).item())
            top1_acc.append(accuracy(np.argmax(output.cpu().numpy(), axis=1), target.cpu().numpy()))
    top1_avg = np.mean(top1_acc)
    print(f"\tTest set:Loss: {np.mean(losses):.6f} Acc@1: {top1_avg:.6f} ")
    return top1_avg


def main():
    args = parse_args()
    device = torch.device(args.device)
    if args.seed is not None:
        torch.manual_seed(args.seed)

    if args.secure_rng:
        try:
            import torchcsprng as prng
        except ImportError as error:
            raise ImportError("--secure-rng needs the torchcsprng package for the loader's generator") from error
        generator = prng.create_random_device_generator("/dev/urandom")
    else:
        generator = None

    train_loader = torch.utils.data.DataLoader(
        random_cifar10(args.examples, seed=1), batch_size=args.batch_size, generator=generator,
        num_workers=args.workers, pin_memory=True)
    test_loader = torch.utils.data.DataLoader(
        random_cifar10(args.test_examples, seed=2), batch_size=args.batch_size_test, shuffle=False,
        num_workers=args.workers)

    model = convnet(num_classes=NUM_CLASSES).to(device)

    if args.optim == "SGD":
        optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                              weight_decay=args.weight_decay)
    elif args.optim == "RMSprop":
        optimizer = optim.RMSprop(model.parameters(), lr=args.lr)
    elif args.optim == "Adam":
        optimizer = optim.Adam(model.parameters(), lr=args.lr)
    else:
        raise NotImplementedError(f"unknown optimizer {args.optim!r}: use SGD, RMSprop or Adam")

    privacy_engine = None
    if not args.disable_dp:
        if args.clip_per_layer:
            n_layers = len([p for p in model.parameters() if p.requires_grad])
            max_grad_norm = [args.max_per_sample_grad_norm / np.sqrt(n_layers)] * n_layers
        else:
            max_grad_norm = args.max_per_sample_grad_norm
        privacy_engine = PrivacyEngine(secure_mode=args.secure_rng)
        model, optimizer, train_loader = privacy_engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=train_loader,
            noise_multiplier=args.sigma,
            max_grad_norm=max_grad_norm,
            clipping="per_layer" if args.clip_per_layer else "flat",
            grad_sample_mode=args.grad_sample_mode,
        )

    best_acc1 = 0
    accuracy_per_epoch, time_per_epoch = [], []
    for epoch in range(args.start_epoch, args.epochs + 1):
        if args.lr_schedule == "cos":
            lr = args.lr * 0.5 * (1 + np.cos(np.pi * epoch / (args.epochs + 1)))
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr

        time_per_epoch.append(train(args, model, train_loader, optimizer, privacy_engine, epoch, device))
        top1_acc = test(args, model, test_loader, device)

        is_best = top1_acc > best_acc1
        best_acc1 = max(top1_acc, best_acc1)
        accuracy_per_epoch.append(float(top1_acc))
        save_checkpoint(
            {
                "epoch": epoch + 1,
                "arch": "Convnet",
                "state_dict": model.state_dict(),
                "best_acc1": best_acc1,
                "optimizer": optimizer.state_dict(),
            },
            is_best,
            filename=args.checkpoint_file + ".tar",
        )

    seconds = [duration.total_seconds() for duration in time_per_epoch]
    print({
        "accuracy": float(best_acc1),
        "accuracy_per_epoch": accuracy_per_epoch,
        "avg_time_per_epoch_str": str(timedelta(seconds=int(sum(seconds) / max(len(seconds), 1)))),
        "time_per_epoch": seconds,
    })


def parse_args():
    parser = argparse.ArgumentParser(description="DP-SGD on CIFAR-10-shaped random data")
    parser.add_argument("--grad_sample_mode", type=str, default="hooks")
    parser.add_argument("-j", "--workers", default=2, type=int, metavar="N", help="data loading workers")
    parser.add_argument("--epochs", default=90, type=int, metavar="N", help="epochs to run")
    parser.add_argument("--start-epoch", default=1, type=int, metavar="N", help="first epoch's number")
    parser.add_argument("-b", "--batch-size-test", default=256, type=int, metavar="N", help="test batch size")
    parser.add_argument("--batch-size", default=2000, type=int, metavar="N",
                        help="expected training batch size (the sample rate is N / examples)")
    parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, metavar="LR", dest="lr",
                        help="initial learning rate")
    parser.add_argument("--momentum", default=0.9, type=float, metavar="M", help="SGD momentum")
    parser.add_argument("--wd", "--weight-decay", default=0, type=float, metavar="W", dest="weight_decay",
                        help="SGD weight decay")
    parser.add_argument("-p", "--print-freq", default=10, type=int, metavar="N",
                        help="print every N steps of an epoch")
    parser.add_argument("--seed", default=None, type=int, help="torch.manual_seed for the model and the training")
    parser.add_argument("--sigma", type=float, default=1.5, metavar="S", help="noise multiplier")
    parser.add_argument("-c", "--max-per-sample-grad_norm", type=float, default=10.0, metavar="C",
                        help="clipping norm of each example's gradient")
    parser.add_argument("--disable-dp", action="store_true", default=False, help="train without privacy")
    parser.add_argument("--secure-rng", action="store_true", default=False,
                        help="draw the randomness from a source nobody can reproduce (slower)")
    parser.add_argument("--delta", type=float, default=1e-5, metavar="D", help="delta of the reported epsilon")
    parser.add_argument("--checkpoint-file", type=str, default="checkpoint",
                        help="checkpoint path without '.tar'; model_best.pth.tar goes to the same folder")
    parser.add_argument("--optim", type=str, default="SGD", help="optimizer (SGD, RMSprop, Adam)")
    parser.add_argument("--lr-schedule", type=str, choices=["constant", "cos"], default="cos")
    parser.add_argument("--device", type=str, default="cpu", help="torch device to train on")
    parser.add_argument("--clip_per_layer", action="store_true", default=False,
                        help="clip each parameter tensor to its share of the norm (Opacus' per-layer clipping)")
    parser.add_argument("--examples", type=int, default=50000, help="training examples (CIFAR-10 has 50000)")
    parser.add_argument("--test-examples", type=int, default=10000, help="test examples (CIFAR-10 has 10000)")
    return parser.parse_args()


if __name__ == "__main__":
    main()
