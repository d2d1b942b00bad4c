#!/usr/bin/env python3
"""DP-SGD on MNIST-shaped data, written the way Opacus' examples/mnist.py is written.

This script is in the shape of Opacus' MNIST example (its options and defaults, a small
convolutional network, a train loop and a test loop, one epsilon line an epoch, several runs
averaged), with the data replaced by random tensors of MNIST's shape (1x28x28 images, 10
classes) so that it needs no download and no torchvision. Its only opake-specific line is the
import of ``PrivacyEngine``: with ``from opacus import PrivacyEngine`` instead it is an Opacus
script (tests/torch/opacus/test_example_scripts.py runs both forms).

Files are written under ``--out-dir`` only (the results of the runs, and the model with
``--save-model``).
"""

import argparse
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from opake.torch import PrivacyEngine

try:
    from tqdm import tqdm
except ImportError:  # progress bars are optional
    def tqdm(iterable, **_):
        return iterable


IMAGE_SHAPE = (1, 28, 28)
NUM_CLASSES = 10


def random_mnist(count, seed):
    """``count`` standardized random images of MNIST's shape with random labels, as a TensorDataset."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(count, *IMAGE_SHAPE, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (count,), generator=generator)
    return torch.utils.data.TensorDataset(images, labels)


class SmallConvNet(nn.Module):
    """Two strided convolutions, each followed by a stride-1 max pool, then two linear layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=8, stride=2, padding=3)   # 28 -> 14
        self.conv2 = nn.Conv2d(16, 32, kernel_size=4, stride=2)             # 13 -> 5
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, NUM_CLASSES)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 1)    # 14 -> 13
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 1)    # 5 -> 4
        x = x.view(-1, 32 * 4 * 4)
        return self.fc2(F.relu(self.fc1(x)))

    def name(self):
        return "SmallConvNet"


def train(args, model, device, train_loader, optimizer, privacy_engine, epoch):
    model.train()
    criterion = nn.CrossEntropyLoss()
    losses = []
    for data, target in tqdm(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = criterion(model(data), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    if args.disable_dp:
        print(f"Train Epoch: {epoch} \t Loss: {np.mean(losses):.6f}")
    else:
        epsilon = privacy_engine.accountant.get_epsilon(delta=args.delta)
        print(f"Train Epoch: {epoch} \tLoss: {np.mean(losses):.6f} (ε = {epsilon:.2f}, δ = {args.delta})")


def test(model, device, test_loader):
    model.eval()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    total_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in tqdm(test_loader):
            data, target = data.to(device), target.to(device)
            output = model(data)
            total_loss += criterion(output, target).item()
            correct += (output.argmax(dim=1) == target).sum().item()
    count = len(test_loader.dataset)
    print(f"\nTest set: Average loss: {total_loss / count:.4f}, "
          f"Accuracy: {correct}/{count} ({100.0 * correct / count:.2f}%)\n")
    return correct / count


def parse_args():
    parser = argparse.ArgumentParser(description="DP-SGD on MNIST-shaped random data",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("-b", "--batch-size", type=int, default=64, metavar="B",
                        help="expected batch size (the sample rate is B / examples)")
    parser.add_argument("--test-batch-size", type=int, default=1024, metavar="TB", help="batch size for testing")
    parser.add_argument("-n", "--epochs", type=int, default=10, metavar="N", help="epochs to train")
    parser.add_argument("-r", "--n-runs", type=int, default=1, metavar="R", help="runs to average the accuracy on")
    parser.add_argument("--lr", type=float, default=0.1, metavar="LR", help="learning rate")
    parser.add_argument("--sigma", type=float, default=1.0, metavar="S", help="noise multiplier")
    parser.add_argument("-c", "--max-per-sample-grad_norm", type=float, default=1.0, metavar="C",
                        help="clipping norm of each example's gradient")
    parser.add_argument("--delta", type=float, default=1e-5, metavar="D", help="delta of the reported epsilon")
    parser.add_argument("--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device to train on")
    parser.add_argument("--save-model", action="store_true", default=False, help="save the last trained model")
    parser.add_argument("--disable-dp", action="store_true", default=False, help="train without privacy")
    parser.add_argument("--secure-rng", action="store_true", default=False,
                        help="draw the randomness from a source nobody can reproduce (slower)")
    parser.add_argument("--examples", type=int, default=60000, help="training examples (MNIST has 60000)")
    parser.add_argument("--test-examples", type=int, default=10000, help="test examples (MNIST has 10000)")
    parser.add_argument("--seed", type=int, default=None, help="torch.manual_seed for the model and the training")
    parser.add_argument("--out-dir", type=str, default=".", help="folder the results (and the model) go to")
    return parser.parse_args()


def main():
    args = parse_args()
    device = torch.device(args.device)
    if args.seed is not None:
        torch.manual_seed(args.seed)

    train_loader = torch.utils.data.DataLoader(
        random_mnist(args.examples, seed=1), batch_size=args.batch_size, num_workers=0, pin_memory=True)
    test_loader = torch.utils.data.DataLoader(
        random_mnist(args.test_examples, seed=2), batch_size=args.test_batch_size, shuffle=True, num_workers=0,
        pin_memory=True)

    run_results = []
    for _ in range(args.n_runs):
        model = SmallConvNet().to(device)
        optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0)
        privacy_engine = None
        if not args.disable_dp:
            privacy_engine = PrivacyEngine(secure_mode=args.secure_rng)
            # As in Opacus' example, a later run privatizes the loader the previous run returned.
            model, optimizer, train_loader = privacy_engine.make_private(
                module=model,
                optimizer=optimizer,
                data_loader=train_loader,
                noise_multiplier=args.sigma,
                max_grad_norm=args.max_per_sample_grad_norm,
            )
        for epoch in range(1, args.epochs + 1):
            train(args, model, device, train_loader, optimizer, privacy_engine, epoch)
        run_results.append(test(model, device, test_loader))

    if len(run_results) > 1:
        print(f"Accuracy averaged over {len(run_results)} runs: "
              f"{np.mean(run_results) * 100:.2f}% ± {np.std(run_results) * 100:.2f}%")

    os.makedirs(args.out_dir, exist_ok=True)
    tag = f"mnist_{args.lr}_{args.sigma}_{args.max_per_sample_grad_norm}_{args.batch_size}_{args.epochs}"
    torch.save(run_results, os.path.join(args.out_dir, f"run_results_{tag}.pt"))
    if args.save_model:
        torch.save(model.state_dict(), os.path.join(args.out_dir, f"mnist_cnn_{tag}.pt"))


if __name__ == "__main__":
    main()
